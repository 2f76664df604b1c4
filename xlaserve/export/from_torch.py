"""Export a PyTorch ``nn.Module`` as a bundle: ``torch.export``, then torch-mlir's StableHLO
lowering, verified against the module itself in eager PyTorch.

Install with ``pip install -e ".[export-torch]"`` (pinned: docs/export.md says which versions
and why torch-mlir rather than torchax or torch_xla). Nothing else in xlaserve imports this
module or torch: the command imports it only for ``xlaserve export --torch``.

How the module becomes a bundle, once per compiled batch size:

1. The module's state (its ``state_dict``: parameters and persistent buffers such as BatchNorm's
   running statistics, under the module's own names, a tensor shared under two names once; then
   its non-persistent buffers, such as BERT's ``embeddings.position_ids``, under their attribute
   paths) is made into arguments: a wrapper calls ``torch.func.functional_call(module, state, inputs)``,
   so ``torch.export`` sees the weights as inputs instead of constants to fold into the program.
2. ``torch.export.export`` traces the wrapper at that batch size (static shapes), and
   ``torch_mlir.fx.export_and_import(..., output_type="stablehlo")`` lowers it to a StableHLO
   ``@main(weights..., inputs...)``: by the first of :data:`ROUTES` that succeeds, torch-mlir on
   the program as traced, else on the program with the ops torch-mlir fails on rewritten
   (:mod:`xlaserve.export.torch_rewrites`), the lowering's memory bounded (:data:`LOWERING_MEMORY_BYTES`). torch-mlir writes every literal tensor of more than one
   element (index tensors of an adaptive pooling, say) as a ``dense_resource`` constant, which
   XLA refuses; :func:`xlaserve.runtime.pjrt.resolve_dense_resources` makes each an inline
   ``dense`` constant, or, above :data:`INLINE_CONSTANT_BYTES`, a weight named
   ``constant.<key>`` that every module takes after the module's state. The result is written
   as ``model.b{N}.mlir``.
3. The weights go to ``weights.safetensors`` under their ``state_dict`` names, in the order the
   module takes them (``weights.order``), so ``module.load_state_dict(safetensors.torch.load_file(
   path), strict=False)`` reads them back (``strict=False`` because non-persistent buffers are
   stored too, which ``load_state_dict`` does not expect).

The outputs are the module's returned tensors flattened the way PyTorch flattens them: one
tensor is ``output``, a tuple or list gives ``output0``, ``output1``..., a dict its keys in its
own order (nested containers join with ``.``). Their axes are found by running the module at two
batch sizes, as :func:`xlaserve.export.from_jax.output_specs` says. Then every module is verified
(:func:`xlaserve.export.verify.verify_bundle`) against the module run eagerly on the cpu.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch_mlir import fx as torch_mlir_fx
from torch_mlir import ir as torch_mlir_ir
from torch_mlir.dialects import torch as torch_dialect
from torch_mlir.extras.fx_importer import FxImporter
from torch_mlir.extras.fx_decomp_util import get_decomposition_table

from xlaserve.export import torch_rewrites
from xlaserve.export.from_jax import hooks_skeleton, output_specs
from xlaserve.export.spec import (DTYPES, ExportError, TensorSpec, TracingError, abstract_shape,
                                  check_batch_sizes, dtype_code, module_file_name)
from xlaserve.export.verify import Verification, sample_inputs, verify_bundle
from xlaserve.export.writer import write_bundle
from xlaserve.runtime.pjrt import dense_resources, resolve_dense_resources

log = logging.getLogger("xlaserve.export")

__all__ = ["ROUTES", "Functional", "TorchExport", "export_torch", "lower_module", "module_from", "state_weights",
           "to_numpy", "to_torch"]


@dataclasses.dataclass(frozen=True, slots=True)
class TorchExport:
    """What :func:`export_torch` wrote and found: the bundle directory, the output specs, the
    weights in binding order (``state_dict`` names, then non-persistent buffers' attribute paths,
    then any ``constant.<key>`` of the lowering), notes on defaults it chose, the
    verification (None when ``verify=False``), and the lowering route (:data:`ROUTES`) that made
    the modules."""

    bundle: Path
    outputs: tuple[TensorSpec, ...]
    weights_order: tuple[str, ...]
    notes: tuple[str, ...]
    verification: Verification | None
    route: str = "torch-mlir"


def module_from(found: Any, where: str) -> torch.nn.Module:
    """``found`` if it is an ``nn.Module``, else what calling it with no arguments returns (a
    factory), which must be one; otherwise an :class:`ExportError` naming ``where``."""
    model = found() if callable(found) and not isinstance(found, torch.nn.Module) else found
    if not isinstance(model, torch.nn.Module):
        raise ExportError(f"{where}: expected a torch.nn.Module or a function returning one,"
                          f" found {type(model).__name__}")
    return model


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A cpu copy of ``tensor`` as a NumPy array of the same dtype (bfloat16 included, which
    ``Tensor.numpy()`` refuses)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return tensor.numpy().copy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A NumPy array (bfloat16 included) as a cpu tensor of the same dtype."""
    array = np.asarray(array, order="C")
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def state_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the module's computation reads from its state: every parameter and
    persistent buffer by ``state_dict`` name, in ``state_dict`` order, then every non-persistent
    buffer (``register_buffer(..., persistent=False)``, such as BERT's
    ``embeddings.position_ids``) by its attribute path, in ``named_buffers`` order. A tensor
    reachable under two names (tied weights) is listed once, under its first name;
    ``functional_call`` ties the others to it.

    Non-persistent buffers are not in the ``state_dict``, but ``torch.export`` lifts them into
    the program like any buffer, and torch-mlir's importer then finds no value for them; passed
    as weights, they are arguments of the module like the rest of its state."""
    weights: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    state = module.state_dict(keep_vars=True)
    extra = ((name, buffer) for name, buffer in module.named_buffers() if name not in state)
    for name, tensor in (*state.items(), *extra):
        if not isinstance(tensor, torch.Tensor):
            continue                     # a module's get_extra_state() object, not a tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        weights[name] = tensor.detach()
    return weights


class Functional(torch.nn.Module):
    """``module`` with its state as leading arguments: ``forward(*weights, *inputs)`` returns the
    module's output tensors flattened (:func:`torch.utils._pytree.tree_leaves`)."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.names = tuple(names)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(self.names)
        state = dict(zip(self.names, args[:count]))
        result = torch.func.functional_call(self.module, state, tuple(args[count:]))
        return tuple(pytree.tree_leaves(result))


def _key_name(key: Any) -> str:
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)


def _named_outputs(result: Any, where: str) -> list[tuple[str, np.ndarray]]:
    """The module's returned tensors as (default name, array), in PyTorch's flattening order."""
    leaves = pytree.tree_flatten_with_path(result)[0]
    named = []
    for path, leaf in leaves:
        name = ".".join(_key_name(key) for key in path)
        if path and isinstance(path[0], pytree.SequenceKey):
            name = "output" + name       # a tuple of outputs: output0, output1, ...
        if not isinstance(leaf, torch.Tensor):
            raise ExportError(f"{where} returned {type(leaf).__name__} {leaf!r} as output"
                              f" {name or 'output'!r}; every output must be a tensor")
        named.append((name or "output", to_numpy(leaf)))
    if not named:
        raise ExportError(f"{where} returned no tensors")
    return named


def _signature(module: torch.nn.Module, inputs: Sequence[TensorSpec], batch: int) -> str:
    shown = ", ".join(
        f"{spec.name}={abstract_shape(spec.row_major(batch), DTYPES[spec.dtype])}" for spec in inputs
    )
    return f"{type(module).__name__}.forward({shown})"


def _run_eager(module: torch.nn.Module, arrays: Sequence[np.ndarray]) -> Any:
    with torch.no_grad():
        return module(*[to_torch(a) for a in arrays])


#: The lowering routes, tried in this order until one lowers the program: torch-mlir on the
#: program as ``torch.export`` traced it, then torch-mlir after :mod:`xlaserve.export.torch_rewrites`
#: (fused attention and nearest-neighbour upsampling decomposed into plain ops, slices clamped
#: to their axes). docs/export.md has the table of which zoo model needs which, measured.
ROUTES = ("torch-mlir", "torch-mlir+rewrites")

#: The most memory (bytes of address space above what the process holds) one lowering may
#: take before it fails with ``std::bad_alloc`` instead of taking the machine's memory (torch-mlir
#: lowering a ``slice_scatter`` with an open end has taken gigabytes); None: half the machine's.
LOWERING_MEMORY_BYTES: int | None = None


def lower_module(wrapper: Functional, weights: Sequence[torch.Tensor], arrays: Sequence[np.ndarray],
                 routes: Sequence[str] = ROUTES) -> tuple[bytes, str, list[str]]:
    """One compiled batch size: ``torch.export`` at the sample's shapes, then StableHLO text by
    the first of ``routes`` that lowers it; returns (text, that route, each failed route's error
    as one line). ``torch.export`` failing raises as it is; every route failing raises the
    first route's :class:`LoweringError`, naming the others' errors."""
    args = (*weights, *[to_torch(a) for a in arrays])
    # torch.export prints the partial graph of a failed export to stderr itself; the failure is
    # reported as one TracingError line instead, and the graph goes to the debug log.
    printed = io.StringIO()
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stderr(printed):
            # torch 2.13 deprecates a pytree check that torch.export still makes; not the user's to fix
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    FutureWarning)
            program = torch.export.export(wrapper, args, strict=False)
            failed: list[tuple[str, Exception]] = []
            for route in routes:
                try:
                    return _decompose_and_lower(program, route), route, [f"{r}: {e}" for r, e in failed]
                except Exception as exc:
                    failed.append((route, exc))
                    log.debug("lowering route %s failed", route, exc_info=exc)
            first = failed[0][1]
            if len(failed) == 1:
                raise first
            others = "; ".join(f"route {r} failed too: {' '.join(str(e).split())[:300]}" for r, e in failed[1:])
            raise LoweringError(f"{first} ({others})") from first
    finally:
        if printed.getvalue().strip():
            log.debug("torch.export printed: %s", printed.getvalue())


@contextlib.contextmanager
def _memory_guard(budget: int | None):
    """The process's address space limited to what it holds now plus ``budget`` bytes (half the
    machine's memory if None) while the block runs, so that a lowering that would take all of it
    fails with ``std::bad_alloc`` instead; the old limit is restored after. Linux only (elsewhere,
    or where the limit cannot be set, no guard). What the block raises passes through as it is."""
    restore = _limit_address_space(budget)
    try:
        yield
    finally:
        if restore is not None:
            restore()


def _limit_address_space(budget: int | None) -> Callable[[], None] | None:
    """Set :func:`_memory_guard`'s limit; how to put the old one back, or None when none was set."""
    try:
        import resource
        held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        if budget is None:
            budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = held + budget
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft != resource.RLIM_INFINITY and soft <= limit:
            return None                 # already as tight
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _decompose_and_lower(exported: torch.export.ExportedProgram, route: str) -> bytes:
    if route not in ROUTES:
        raise ValueError(f"lowering route {route!r}: expected one of {', '.join(ROUTES)}")
    table = get_decomposition_table()
    if route == "torch-mlir+rewrites":
        table = {**table, **torch_rewrites.DECOMPOSITIONS}
    try:
        program = exported.run_decompositions(table)
    except Exception as exc:
        raise LoweringError(f"the decomposition of the exported program into the ops torch-mlir lowers"
                            f" failed: {type(exc).__name__}: {exc}") from exc
    if route == "torch-mlir+rewrites":
        torch_rewrites.clamp_slices(program.graph_module.graph)
        program.graph_module.recompile()
    # torch.export lists the module's own state as inputs of the program too (unused: the
    # wrapper's arguments replace it), and torch-mlir's importer looks every buffer up in
    # the program's state_dict, where non-persistent buffers are not: they are among its
    # constants. Give the importer their values where it looks, after the decompositions
    # (whose check of the program refuses a non-persistent buffer in the state_dict), and
    # have it decompose nothing more.
    for buffer in program.graph_signature.non_persistent_buffers:
        if buffer not in program.state_dict and buffer in program.constants:
            program.state_dict[buffer] = program.constants[buffer]
    # MLIR prints its diagnostics (what failed to legalize) to the process's stderr and
    # raises with a generic message; kept here instead, the first error is the message.
    context = torch_mlir_ir.Context()
    torch_dialect.register_dialect(context)
    errors: list[str] = []

    def keep(diagnostic) -> bool:
        if diagnostic.severity == torch_mlir_ir.DiagnosticSeverity.ERROR:
            errors.append(diagnostic.message)
        return True

    handler = context.attach_diagnostic_handler(keep)
    importer = FxImporter(context=context)
    try:
        with _memory_guard(LOWERING_MEMORY_BYTES):
            lowered = torch_mlir_fx.export_and_import(program, output_type="stablehlo", func_name="main",
                                                      decomposition_table={}, fx_importer=importer)
            return str(lowered).encode()
    except Exception as exc:
        found = errors[0] if errors else f"{type(exc).__name__}: {exc}"
        raise LoweringError(f"torch-mlir could not lower the exported program to StableHLO"
                            f"{_unlowered(importer, program)}: {found}") from exc
    finally:
        handler.detach()


# torch-mlir's own ops for what the program calls under another name
_LOWERED_FROM = {"aten.__interpolate": ("aten.upsample_", "aten.interpolate")}


def _unlowered(importer: FxImporter, program: torch.export.ExportedProgram) -> str:
    """Where a failed lowering stopped: the aten ops left in torch-mlir's module (the pipeline
    stops with them unconverted) and, for those the program calls by the same name, the module
    paths that call them (from ``nn_module_stack``); empty if none is found."""
    left: set[str] = set()

    def visit(op):
        name = op.operation.name if hasattr(op, "operation") else op.name
        if name.startswith("torch.aten."):
            left.add(name[len("torch."):])
        return torch_mlir_ir.WalkResult.ADVANCE

    try:
        importer.module.operation.walk(visit)
    except Exception:          # a module the failure left unreadable: nothing more to say
        return ""
    if not left:
        return ""
    paths: dict[str, set[str]] = {}
    for node in program.graph.nodes:
        target = str(node.target) if node.op == "call_function" else ""
        for name in left:
            called = _LOWERED_FROM.get(".".join(name.split(".")[:2]), ())
            if target == name or target.startswith(name + ".") or target.startswith(called):
                stack = list((node.meta.get("nn_module_stack") or {}).values())
                if stack:                 # (path, type): the innermost module; the wrapper's prefix dropped
                    path = stack[-1][0].removeprefix("module.").removeprefix("module")
                    paths.setdefault(name, set()).add(f"{path or '(the model itself)'} ({stack[-1][1].rsplit('.', 1)[-1]})")
    shown = [name + (f" in {', '.join(sorted(paths[name]))}" if name in paths else "") for name in sorted(left)]
    return f" (left unlowered: {'; '.join(shown)})"


class LoweringError(RuntimeError):
    """``torch.export`` traced the module, then decomposing or lowering the program failed; the
    message is MLIR's first error (``failed to legalize operation ...``), torch-mlir's own, or the
    decomposition's, then what the other routes raised."""


#: torch-mlir writes every literal tensor of more than one element as a ``dense_resource``
#: constant, which XLA refuses; up to this many bytes one is written into the module inline
#: (``dense<...>``), a larger one is passed as a weight (:func:`_large_constants`).
INLINE_CONSTANT_BYTES = 64 * 1024


def _large_constants(lowered: Mapping[str, str], taken: set[str]) -> dict[str, np.ndarray]:
    """The ``dense_resource`` constants of the lowered modules larger than
    :data:`INLINE_CONSTANT_BYTES`, once each by value (every module takes all of them), named
    ``constant.<resource key>`` (with a ``.N`` suffix where a name is already taken)."""
    found: dict[str, np.ndarray] = {}
    seen: set[tuple[str, tuple[int, ...], bytes]] = set()
    for text in lowered.values():
        for key, array in dense_resources(text).items():
            identity = (array.dtype.str, array.shape, array.tobytes())
            if array.nbytes <= INLINE_CONSTANT_BYTES or identity in seen:
                continue
            seen.add(identity)
            weight, suffix = f"constant.{key}", 1
            while weight in taken or weight in found:
                weight, suffix = f"constant.{key}.{suffix}", suffix + 1
            found[weight] = array
    return found


def export_torch(
    out_dir: str | os.PathLike[str],
    module: torch.nn.Module,
    *,
    inputs: Sequence[TensorSpec],
    compiled_batch_sizes: Sequence[int],
    output_names: Sequence[str] | None = None,
    output_axes: Mapping[str, str] | None = None,
    extra_files: Mapping[str, str] | None = None,
    hooks: bool = False,
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    routes: Sequence[str] = ROUTES,
) -> TorchExport:
    """Export ``module`` as a bundle at ``out_dir`` and verify it against the module in eager
    PyTorch (see the module docstring for how).

    ``inputs`` are the tensors ``module.forward`` takes, in order, row-major with the batch where
    their axes say. The module is exported and verified in eval mode on the cpu: one in training
    mode is switched to eval mode (with a note), and the module is moved to the cpu, both in
    place, as ``nn.Module.eval`` and ``.to`` do. ``output_names`` renames the outputs in order; ``output_axes`` names
    the axes of outputs whose batch is not their first axis; ``hooks`` adds a pass-through
    ``model.py``. With ``verify`` (the default) every module is loaded the way the server loads
    it and run on seeded random inputs next to the module, both on the cpu, and compared with
    ``atol``/``rtol`` (default per dtype, :mod:`xlaserve.export.verify`); above them
    :class:`xlaserve.export.verify.VerificationError` is raised and the bundle stays written for
    inspection. ``progress`` hears the notes, then one line per size lowered, module compiled
    and output verified. ``routes`` are the lowering routes to try, in order (:data:`ROUTES`);
    a size lowered by other than the first has a note saying what the ones before it raised, and
    :attr:`TorchExport.route` names the route that made the modules.

    The module failing to run, to export or to lower raises :class:`TracingError` naming the
    batch size and the inputs it was called with; anything else it cannot do is an
    :class:`ExportError`.
    """
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"expected a torch.nn.Module, found {type(module).__name__}")
    out_dir = Path(out_dir)
    name = out_dir.name
    inputs = list(inputs)
    sizes = check_batch_sizes(compiled_batch_sizes)
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        if progress is not None:
            progress(f"note: {text}")

    if module.training:
        note(f"{type(module).__name__} was in training mode; exported and verified in eval mode")
        module.eval()
    module = module.to("cpu")
    weights = state_weights(module)
    names = list(weights)
    arrays: dict[str, np.ndarray] = {}
    for weight_name, tensor in weights.items():
        array = to_numpy(tensor)
        try:
            dtype_code(array.dtype)
        except ValueError:
            raise ExportError(f"weight {weight_name!r}: dtype {tensor.dtype} cannot be stored in a bundle;"
                              f" expected one of {', '.join(d.name for d in DTYPES.values())}") from None
        arrays[weight_name] = array

    # Two different sizes tell the batch axis from the others; the second need not be compiled.
    first, second = sizes[0], (sizes[1] if len(sizes) > 1 else sizes[0] + 1)
    found: dict[int, list[tuple[str, np.ndarray]]] = {}
    for batch in (first, second):
        try:
            result = _run_eager(module, sample_inputs(inputs, batch, seed))
        except Exception as exc:
            raise TracingError(name, batch, exc, _signature(module, inputs, batch)) from exc
        found[batch] = _named_outputs(result, _signature(module, inputs, batch))
    if [n for n, _ in found[first]] != [n for n, _ in found[second]]:
        raise ExportError(f"{type(module).__name__} returns different outputs at batch sizes {first}"
                          f" and {second}: {[n for n, _ in found[first]]} and {[n for n, _ in found[second]]}")
    outputs, defaulted = output_specs(
        [n for n, _ in found[first]], [a for _, a in found[first]], [a for _, a in found[second]],
        first, second, names=output_names, axes=output_axes)
    for text in defaulted:
        note(text)

    wrapper = Functional(module, names)
    lowered: dict[str, str] = {}
    routes = tuple(routes)
    unknown = [r for r in routes if r not in ROUTES]
    if unknown or not routes:
        raise ExportError(f"lowering routes {list(routes)}: expected one or more of {', '.join(ROUTES)}")
    for index, batch in enumerate(sizes, 1):
        started = time.perf_counter()
        try:
            text, route, failed = lower_module(wrapper, list(weights.values()), sample_inputs(inputs, batch, seed),
                                               routes)
        except Exception as exc:
            stage = "lowered by torch-mlir" if isinstance(exc, LoweringError) else "traced"
            raise TracingError(name, batch, exc, _signature(module, inputs, batch), stage) from exc
        lowered[module_file_name(batch)] = text.decode()
        if failed:
            note(f"lowered by route {route} at batch size {batch}: "
                 + "; ".join(f"route {' '.join(line.split())[:400]}" for line in failed))
        routes = routes[routes.index(route):]       # the other sizes start where this one succeeded
        if progress is not None:
            progress(f"{name}: exported and lowered compiled batch size {batch} ({index}/{len(sizes)})"
                     f" in {time.perf_counter() - started:.2f}s")

    constants = _large_constants(lowered, set(names))
    if constants:
        note(f"{len(constants)} constant(s) of the lowered program larger than {INLINE_CONSTANT_BYTES}"
             f" bytes ({sum(a.nbytes for a in constants.values())} bytes) are passed as weights:"
             f" {', '.join(constants)}")
    modules = {file: resolve_dense_resources(text, list(constants.values()), at=len(names)).encode()
               for file, text in lowered.items()}
    arrays.update(constants)
    names += list(constants)

    if hooks:
        extra_files = {**(extra_files or {}), "model.py": hooks_skeleton(name, inputs, outputs)}
    write_bundle(out_dir, modules, inputs=inputs, outputs=outputs, weights=arrays or None,
                 weights_order=names, compiled_batch_sizes=sizes, extra_files=extra_files)

    verification = None
    if verify:
        def reference(*batch_arrays: np.ndarray) -> list[np.ndarray]:
            result = _run_eager(module, batch_arrays)
            return [a for _, a in _named_outputs(result, type(module).__name__)]
        verification = verify_bundle(out_dir, reference, atol=atol, rtol=rtol, seed=seed,
                                     progress=progress)
    return TorchExport(out_dir, tuple(outputs), tuple(names), tuple(notes), verification, routes[0])
