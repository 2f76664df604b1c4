"""The one module that touches JAX internals.

Everything xlaserve needs from JAX's PJRT client lives here: finding out whether jax's CUDA
plugin can be used (:func:`probe_cuda`), setting up the client before it exists
(:func:`configure_client`), opening a backend (``jax.extend.backend``), reading a StableHLO
module's ``@main`` signature (jaxlib's MLIR bindings), specializing a module exported with a
symbolic batch to one static size (:func:`specialize`: StableHLO shape refinement, as jax does for
its own shape-polymorphic modules), rewriting modules to take convolution kernels in the order
the cpu wants them (:func:`kernel_permutations`, :func:`relayout`), merging common
subexpressions of exported text (:func:`eliminate_common_subexpressions`), writing depthwise convolutions out as
sums the cpu runs fast (:func:`rewrite_depthwise_convolutions`) and keeping convolutions'
activations channels-last between them (:func:`channels_last_activations`), replacing the
``dense_resource`` constants XLA refuses (:func:`dense_resources`, :func:`resolve_dense_resources`), compiling
(``compile_and_load``, with :data:`COMPILE_OVERRIDES`),
executing (``execute_sharded``), copying host arrays to the device (``batched_device_put``:
``jax.device_put`` costs about 80 µs a call on this path, the call underneath it about 7), and
(de)serializing executables. The jax version is pinned in pyproject.toml because these names
move between releases. Nothing else in the server imports jax or jaxlib (the export API,
:mod:`xlaserve.export`, and the benchmarks use jax to build bundles).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import jax
import jaxlib
from jax.extend import backend as jax_backend
from jax.extend import mlir as jax_mlir
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import hardware_utils, xla_bridge
from jax._src.interpreters import mlir as jax_mlir_internal
from jax._src.lib import _jax, xla_client
from jax._src.lib.mlir import ir, passmanager
from jax._src.lib.mlir.dialects import hlo

from xlaserve.dtypes import BY_MLIR
from xlaserve.runtime.signature import ModuleError, Signature, TensorType

JAX_VERSION = jax.__version__
JAXLIB_VERSION = jaxlib.__version__


# The module names jax's CUDA plugin installs under (``jax[cuda13]``, ``jax[cuda12]``), newest first.
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


@dataclass(frozen=True, slots=True)
class CudaProbe:
    """What this process can tell about the ``cuda`` backend without creating its client.

    ``installed``: jax's CUDA plugin is installed. ``devices``: the GPUs it sees (0 when it
    cannot be used). ``problem``: why ``cuda`` cannot be used here, '' when it can.
    """

    installed: bool
    devices: int
    problem: str

    @property
    def usable(self) -> bool:
        return not self.problem


@functools.cache
def probe_cuda() -> CudaProbe:
    """Whether jax's CUDA plugin is installed and how many GPUs it sees, found without creating
    a PJRT client, so that no device memory is claimed and a later client in this process (or
    a worker process) still owns the devices. The plugin is loaded the way jax loads it (its
    ``initialize()``, which checks its CUDA libraries) and asked for the device count
    (``cudaGetDeviceCount``, which honours ``CUDA_VISIBLE_DEVICES``). Cached: the answer is a
    fact about the process."""
    plugin = _installed_cuda_plugin()
    if plugin is None:
        return CudaProbe(False, 0, "jax's CUDA plugin is not installed")
    if not hardware_utils.has_visible_nvidia_gpu():
        # the same test jax applies before it tries the cuda backend
        return CudaProbe(True, 0, "jax's CUDA plugin is installed but no NVIDIA GPU is visible "
                                  "(none of /dev/nvidia0, /dev/nvidiactl, /dev/dxg exists)")
    xla_bridge._discover_and_register_pjrt_plugins()
    if "cuda" not in xla_bridge._backend_factories:
        return CudaProbe(True, 0, f"jax's CUDA plugin ({plugin}) is installed but did not load (jax logged why "
                                  "above: usually CUDA libraries older than the plugin needs)")
    versions = getattr(sys.modules.get(plugin), "cuda_versions", None)
    try:
        count = int(versions.cuda_device_count())
    except Exception as exc:  # the plugin's native helper is missing or CUDA refused to answer
        return CudaProbe(True, 0, f"jax's CUDA plugin ({plugin}) cannot count the GPUs: {_first_line(exc)}")
    if count < 1:
        return CudaProbe(True, 0, "jax's CUDA plugin sees no GPU (check the NVIDIA driver and "
                                  "CUDA_VISIBLE_DEVICES)")
    return CudaProbe(True, count, "")


def _installed_cuda_plugin() -> str | None:
    for name in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ImportError:  # no jax_plugins package at all
            return None
    return None


def cuda_client_options(mem_fraction: float, preallocate: bool) -> dict[str, str | float | bool]:
    """The PJRT client-create options that size the CUDA client's device allocator: XLA's BFC
    pool, which may grow to ``mem_fraction`` of the device's memory and, with ``preallocate``,
    claims all of that when the client is created. These are the options jax derives from
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and ``XLA_PYTHON_CLIENT_PREALLOCATE``; passed through
    :func:`configure_client` they win over those variables."""
    return {"allocator": "bfc", "memory_fraction": float(mem_fraction), "preallocate": bool(preallocate)}


def configure_client(backend: str, cuda_options: Mapping[str, str | float | bool] | None = None) -> None:
    """Set up the PJRT clients this process will create: only ``backend``'s (``cuda`` also
    gets a ``cpu`` client beside it), the ``cuda`` one with ``cuda_options`` (see
    :func:`cuda_client_options`). Without this jax creates a client for every platform it
    finds, so a ``cpu`` worker on a GPU machine would claim GPU memory.

    Must run before the first :class:`Device` of the process: jax reads these settings when it
    creates its clients, once. RuntimeError if the clients already exist with other settings.
    """
    platforms = "cpu" if backend == "cpu" else f"{backend},cpu"
    options = dict(cuda_options) if cuda_options and backend == "cuda" else None
    if xla_bridge.backends_are_initialized():
        if (jax_config.jax_platforms.value, jax_config.jax_pjrt_client_create_options.value) == (platforms, options):
            return
        raise RuntimeError(f"cannot configure the {backend} client: jax's PJRT clients already exist in this "
                           "process (configure_client must run before the first Device is opened)")
    jax.config.update("jax_platforms", platforms)
    jax.config.update("jax_pjrt_client_create_options", options)


_context_lock = threading.Lock()


def _parse(module: bytes, ctx) -> ir.Module:
    """A StableHLO module given as text, MLIR bytecode or a portable (VHLO) artifact, parsed
    into ``ctx`` as StableHLO."""
    try:
        parsed = ir.Module.parse(module, context=ctx)
    except Exception as exc:  # MLIR raises a bare Exception subclass with diagnostics
        raise ModuleError(f"not a parsable StableHLO module: {_first_line(exc)}") from None
    if any(op.operation.name.startswith("vhlo.") for op in parsed.body.operations):
        try:
            parsed = jax_mlir.deserialize_portable_artifact(module)
        except Exception as exc:
            raise ModuleError(f"not a readable portable StableHLO artifact: {_first_line(exc)}") from None
        if isinstance(parsed, (str, bytes)):
            parsed = ir.Module.parse(parsed, context=ctx)
    return parsed


def _main(parsed: ir.Module):
    for op in parsed.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise ModuleError("the module has no func.func @main")


def read_signature(module: bytes) -> Signature:
    """The ``@main`` signature of a StableHLO module given as text, MLIR bytecode or a portable
    (VHLO) artifact."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        parsed = _parse(module, ctx)      # held while its ops are read: they die with it
        main = _main(parsed)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        return Signature(tuple(_tensor_type(t) for t in ftype.inputs),
                         tuple(_tensor_type(t) for t in ftype.results))


def specialize(module: bytes, arguments: Sequence[TensorType]) -> bytes:
    """``module`` (text, bytecode or portable artifact) with ``@main`` taking exactly the static
    ``arguments`` types, its dynamic dimensions resolved throughout: StableHLO bytecode that
    :meth:`Device.compile` takes like any module.

    ``@main``'s arguments get the static types; each argument whose type changed is converted
    back to its old (dynamic) type for the body (``stablehlo.convert``, as jax's own calls of
    exported functions do), and StableHLO's shape refinement, the one jax runs on its own
    shape-polymorphic modules, then propagates the static shapes through the program, checks its
    shape assertions (a module exported with ``b <= 8`` refuses 16) and verifies that no dynamic
    shape is left. Deterministic: the same module and arguments give the same bytes, so an
    executable cache keyed on them finds its entry again.

    Raises :class:`ModuleError` naming what did not fit: an argument count or type that is not a
    specialization of ``@main``'s (a static dimension or element type changed), or a module
    whose shapes do not all resolve (a shape computed from data, a failing shape assertion).
    """
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx, ir.Location.unknown(ctx):
        parsed = _parse(module, ctx)
        main = _main(parsed)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        if len(ftype.inputs) != len(arguments):
            raise ModuleError(f"@main takes {len(ftype.inputs)} argument(s), {len(arguments)} given")
        static = []
        for index, (old, new) in enumerate(zip(ftype.inputs, arguments)):
            found = _tensor_type(old)
            fits = (len(found.shape) == len(new.shape) and found.element == new.element
                    and all(d is None or d == n for d, n in zip(found.shape, new.shape)))
            if not fits or any(n is None for n in new.shape):
                raise ModuleError(f"argument {index} of @main is {found}, which {new} does not specialize")
            static.append(ir.RankedTensorType.get(list(new.shape), ir.RankedTensorType(old).element_type))
        block = main.regions[0].blocks[0]
        with ir.InsertionPoint.at_block_begin(block):
            for argument, old, new in zip(block.arguments, ftype.inputs, static):
                if new == old:
                    continue
                argument.set_type(new)
                converted = hlo.ConvertOp(old, argument)
                argument.replace_all_uses_except(converted.result, converted.operation)
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(static, ftype.results))
        bytecode = jax_mlir_internal.module_to_bytecode(parsed)
    try:
        refined = jax_mlir.refine_polymorphic_shapes(bytecode, enable_shape_assertions=True,
                                                     validate_static_shapes=True,
                                                     enable_shardy=jax_config.use_shardy_partitioner.value)
    except Exception as exc:  # jaxlib's JaxRuntimeError, with MLIR's diagnostics in the message
        raise ModuleError(f"its shapes do not all resolve: {_first_line(exc)}") from None
    return bytes(refined)


def eliminate_common_subexpressions(module: str) -> str:
    """A StableHLO text module with MLIR's common-subexpression elimination applied, printed as
    jax prints ``Exported.mlir_module()`` (debug locations kept: argument names such as
    ``weights['conv1.w']`` and op names such as ``jit(f)/conv_general_dilated``). Identical
    side-effect-free ops computing the same values are merged, so the program is the same.
    Deterministic. It matters most for a shape-polymorphic module, where jax rebuilds the same
    shape (``reshape`` of the batch size, ``concatenate`` with the static dimensions) before
    every ``dynamic_broadcast_in_dim``."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        try:
            parsed = ir.Module.parse(module, context=ctx)
        except Exception as exc:  # MLIR raises a bare Exception subclass with diagnostics
            raise ModuleError(f"not a parsable StableHLO module: {_first_line(exc)}") from None
        passmanager.PassManager.parse("builtin.module(cse)", context=ctx).run(parsed.operation)
        return parsed.operation.get_asm(enable_debug_info=True)


def kernel_permutations(module: bytes) -> dict[int, tuple[int, ...]]:
    """For each ``@main`` argument that is used only as the kernel of convolutions (directly or
    through ``func.call``), all with the same kernel dimension numbers: the permutation that
    puts it in the order XLA's cpu convolutions take kernels in, spatial dimensions first, then
    input features, then output features (HWIO for a 2-D kernel); and for each argument used
    only through transposes, all with the same permutation (PyTorch's ``Linear`` weight, read as
    ``W.T``): that permutation. Arguments already in that order, or used any other way, are left
    out.

    Why: XLA's cpu backend keeps an entry parameter in the layout it arrives in and transposes
    a kernel given in another order (PyTorch's OIHW) on every call, all of them, before each
    convolution; PJRT's layout options do not change that (a parameter compiled with a
    non-default layout is copied back to row-major first). :func:`relayout` makes the module
    take such arguments already permuted, so that its transpose and XLA's cancel at compile time.
    The same holds for a transposed matrix: MobileNetV3-small's classifier transposed its two
    weights (4 and 2.4 MB) on every call, 4.4 of its 7.6 ms at batch 1.
    """
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        parsed = _parse(module, ctx)
        functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in parsed.body.operations
                     if op.operation.name == "func.func" and op.regions[0].blocks}
        main = _main(parsed)
        found = {}
        for index, argument in enumerate(main.regions[0].blocks[0].arguments):
            orders = _kernel_orders(argument, functions, depth=0)
            if orders is None or len(orders) != 1:
                continue
            order = orders.pop()
            if order != tuple(range(len(order))):
                found[index] = order
        return found


def _kernel_orders(value, functions, depth: int) -> set[tuple[int, ...]] | None:
    """The kernel orders of every convolution ``value`` feeds, or None if it has any other use."""
    orders: set[tuple[int, ...]] = set()
    for use in value.uses:
        op = use.owner
        name = op.name
        if name == "stablehlo.convolution" and use.operand_number == 1:
            dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
            orders.add((*dims.kernel_spatial_dimensions, dims.kernel_input_feature_dimension,
                        dims.kernel_output_feature_dimension))
        elif name == "stablehlo.transpose":
            # a weight the module only ever reads transposed (PyTorch's Linear: x @ W.T)
            orders.add(tuple(int(p) for p in ir.DenseI64ArrayAttr(op.attributes["permutation"])))
        elif name == "func.call" and depth < 8:
            callee = functions.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
            if callee is None:
                return None
            inner = _kernel_orders(callee.regions[0].blocks[0].arguments[use.operand_number], functions, depth + 1)
            if inner is None:
                return None
            orders |= inner
        else:
            return None
    return orders or None


def relayout(module: bytes, permutations: Mapping[int, Sequence[int]]) -> bytes:
    """``module`` (text, bytecode or portable artifact) as StableHLO bytecode whose ``@main``
    takes each argument ``i`` of ``permutations`` transposed by ``permutations[i]`` (the array
    ``numpy.transpose(a, permutations[i])``) and transposes it back first thing, so the rest
    of the module is unchanged. Deterministic, like :func:`specialize`. With no permutations,
    ``module`` itself."""
    if not permutations:
        return module
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx, ir.Location.unknown(ctx):
        parsed = _parse(module, ctx)
        main = _main(parsed)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        inputs = list(ftype.inputs)
        block = main.regions[0].blocks[0]
        with ir.InsertionPoint.at_block_begin(block):
            for index in sorted(permutations):
                perm = tuple(int(p) for p in permutations[index])
                old = ir.RankedTensorType(inputs[index])
                if sorted(perm) != list(range(old.rank)) or any(old.is_dynamic_dim(i) for i in range(old.rank)):
                    raise ModuleError(f"argument {index} of @main is {old}, which {perm} does not permute")
                new = ir.RankedTensorType.get([old.get_dim_size(p) for p in perm], old.element_type)
                argument = block.arguments[index]
                argument.set_type(new)
                back = hlo.TransposeOp(argument, ir.DenseI64ArrayAttr.get([perm.index(j) for j in range(len(perm))]))
                argument.replace_all_uses_except(back.result, back.operation)
                inputs[index] = new
        main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, ftype.results))
        return bytes(jax_mlir_internal.module_to_bytecode(parsed))


# A depthwise convolution with at most this many kernel taps (7x7) is rewritten by
# :func:`rewrite_depthwise_convolutions`; larger kernels are left to XLA.
DEPTHWISE_MAX_TAPS = 49


def _i64s(op, name: str, default: int, rank: int) -> list[int]:
    attr = op.attributes[name] if name in op.attributes else None
    return [int(v) for v in ir.DenseI64ArrayAttr(attr)] if attr is not None else [default] * rank


def _depthwise_shape(op) -> tuple | None:
    """What :func:`_rewrite_depthwise` needs of a ``stablehlo.convolution``, or None when it
    is not a depthwise convolution that rewrite handles: one group per input channel, one output
    channel per group, static f32 shapes, no input dilation or window reversal, at most
    :data:`DEPTHWISE_MAX_TAPS` kernel taps."""
    groups = ir.IntegerAttr(op.attributes["feature_group_count"]).value
    batch_groups = ir.IntegerAttr(op.attributes["batch_group_count"]).value
    if groups < 2 or batch_groups != 1:
        return None
    lhs, rhs = (ir.RankedTensorType(v.type) for v in op.operands)
    out = ir.RankedTensorType(op.results[0].type)
    if (not all(t.has_static_shape for t in (lhs, rhs, out))
            or not all(str(t.element_type) == "f32" for t in (lhs, rhs, out))):
        return None
    dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    rank = len(dims.input_spatial_dimensions)
    if (lhs.get_dim_size(dims.input_feature_dimension) != groups
            or rhs.get_dim_size(dims.kernel_input_feature_dimension) != 1
            or rhs.get_dim_size(dims.kernel_output_feature_dimension) != groups):
        return None
    kernel = [rhs.get_dim_size(d) for d in dims.kernel_spatial_dimensions]
    if int(np.prod(kernel)) > DEPTHWISE_MAX_TAPS or _i64s(op, "lhs_dilation", 1, rank) != [1] * rank:
        return None
    if "window_reversal" in op.attributes and any(ir.DenseBoolArrayAttr(op.attributes["window_reversal"])):
        return None
    padding = ([[int(v) for v in row] for row in np.asarray(ir.DenseIntElementsAttr(op.attributes["padding"])).reshape(rank, 2)]
               if "padding" in op.attributes else [[0, 0]] * rank)
    return dims, kernel, _i64s(op, "window_strides", 1, rank), _i64s(op, "rhs_dilation", 1, rank), padding


def _computed_once(value):
    """``value`` passed through an identity gather: every index, in order, of its first
    dimension longer than 1 (a depthwise result or kernel has one: its channels, at least 2).

    Why: XLA's cpu fusion copies cheap elementwise producers (adds, multiplies, slices) into
    every consumer fusion, so a depthwise sum read by several fusions (a LayerNorm's mean,
    variance and normalization, as in ConvNeXt) is computed again in each: ConvNeXt's 7x7 sums
    ran 3.5 times at batch 8 (1392 slices in the optimized module instead of 392). A gather is
    one of the ops it never duplicates (``CpuInstructionFusion::IsExpensive``), and XLA's
    optimization barrier is removed before fusion, so the identity gather is what makes the sum
    computed once and its result read by the consumers. A single consumer still fuses it."""
    vtype = ir.RankedTensorType(value.type)
    shape = [vtype.get_dim_size(d) for d in range(vtype.rank)]
    axis = next(d for d, size in enumerate(shape) if size > 1)
    i32 = ir.IntegerType.get_signless(32)
    indices = hlo.ConstantOp(ir.DenseElementsAttr.get(np.arange(shape[axis], dtype=np.int32).reshape(-1, 1),
                                                      type=i32)).result
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[d for d in range(vtype.rank) if d != axis], collapsed_slice_dims=[axis],
        operand_batching_dims=[], start_indices_batching_dims=[], start_index_map=[axis], index_vector_dim=1)
    sizes = [1 if d == axis else size for d, size in enumerate(shape)]
    return hlo.GatherOp(value, indices, numbers, ir.DenseI64ArrayAttr.get(sizes), indices_are_sorted=True).result


def _rewrite_depthwise(op, found: tuple, channels_last: bool, once: bool = True) -> None:
    """Replace the depthwise convolution ``op`` by a sum over its kernel taps of a strided
    slice of the padded input times that tap's per-channel weight, broadcast; with ``once``,
    passed through :func:`_computed_once`."""
    dims, kernel, strides, dilation, padding = found
    lhs_value, rhs_value = op.operands
    out_type = ir.RankedTensorType(op.results[0].type)
    f32 = out_type.element_type
    rank = len(kernel)
    # the sum is computed in [batch, channels, spatial...] order, or [batch, spatial..., channels]
    if channels_last:
        x_order = [dims.input_batch_dimension, *dims.input_spatial_dimensions, dims.input_feature_dimension]
        o_order = [dims.output_batch_dimension, *dims.output_spatial_dimensions, dims.output_feature_dimension]
    else:
        x_order = [dims.input_batch_dimension, dims.input_feature_dimension, *dims.input_spatial_dimensions]
        o_order = [dims.output_batch_dimension, dims.output_feature_dimension, *dims.output_spatial_dimensions]
    c_at = rank + 1 if channels_last else 1

    def place(batch_value, channel_value, spatial_values):
        values = [batch_value, *spatial_values]
        values.insert(c_at, channel_value)
        return values

    k_order = [dims.kernel_output_feature_dimension, dims.kernel_input_feature_dimension,
               *dims.kernel_spatial_dimensions]
    batch = out_type.get_dim_size(dims.output_batch_dimension)
    channels = out_type.get_dim_size(dims.output_feature_dimension)
    outs = [out_type.get_dim_size(d) for d in dims.output_spatial_dimensions]
    with ir.InsertionPoint(op), op.location:
        x = lhs_value
        if x_order != list(range(rank + 2)):
            x = hlo.TransposeOp(x, ir.DenseI64ArrayAttr.get(x_order)).result
        zero = hlo.ConstantOp(ir.DenseElementsAttr.get(np.zeros((), np.float32), type=f32)).result
        if any(p != [0, 0] for p in padding):
            x = hlo.PadOp(x, zero, place(0, 0, [p[0] for p in padding]), place(0, 0, [p[1] for p in padding]),
                          [0] * (rank + 2)).result
        w = rhs_value
        if k_order != list(range(rank + 2)):
            w = hlo.TransposeOp(w, ir.DenseI64ArrayAttr.get(k_order)).result
        w = hlo.ReshapeOp(ir.RankedTensorType.get([channels, *kernel], f32), w).result
        # channels-last, each tap's weights are read as a vector over the channels: in [spatial...,
        # channels] order they are contiguous; in the kernel's own [channels, spatial...] order
        # they are strided, which kept XLA from vectorizing the sum (ConvNeXt's 7x7 layers ran
        # 3-4 times slower). The reordered kernel is made once a call, not inside the sum.
        tap_major = channels_last and once
        if tap_major:
            w = _computed_once(hlo.TransposeOp(w, ir.DenseI64ArrayAttr.get([*range(1, rank + 1), 0])).result)
        canonical = ir.RankedTensorType.get(place(batch, channels, outs), f32)
        total = None
        for tap in np.ndindex(*kernel):
            first = [t * d for t, d in zip(tap, dilation)]
            start = place(0, 0, first)
            limit = place(batch, channels, [f + (o - 1) * st + 1 for f, o, st in zip(first, outs, strides)])
            window = hlo.SliceOp(x, start, limit, place(1, 1, strides)).result
            if tap_major:
                weight = hlo.SliceOp(w, [*tap, 0], [*(t + 1 for t in tap), channels], [1] * (rank + 1)).result
            else:
                weight = hlo.SliceOp(w, [0, *tap], [channels, *(t + 1 for t in tap)], [1] * (rank + 1)).result
            weight = hlo.ReshapeOp(ir.RankedTensorType.get([channels], f32), weight).result
            weight = hlo.BroadcastInDimOp(canonical, weight, ir.DenseI64ArrayAttr.get([c_at])).result
            term = hlo.MulOp(window, weight).result
            total = term if total is None else hlo.AddOp(total, term).result
        if once:
            total = _computed_once(total)
        if o_order != list(range(rank + 2)):
            total = hlo.TransposeOp(total, ir.DenseI64ArrayAttr.get([o_order.index(d) for d in range(rank + 2)])).result
    op.results[0].replace_all_uses_with(total)
    op.erase()


def _operations(region_holder):
    for region in region_holder.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op
                yield from _operations(op)


def rewrite_depthwise_convolutions(module: bytes, channels_last: bool = True, computed_once: bool = True) -> bytes:
    """``module`` (text, bytecode or portable artifact) with every depthwise convolution (a
    ``feature_group_count`` equal to the input channels, one output channel per group, f32,
    at most :data:`DEPTHWISE_MAX_TAPS` kernel taps) replaced by the same sum written out: for
    each kernel tap, a strided slice of the zero-padded input times that tap's weights
    broadcast over the channels, accumulated, in ``[batch, spatial..., channels]`` order with
    ``channels_last`` (the default: the order XLA's cpu convolutions keep activations in, so the
    transposes around the sum cancel against theirs; the EfficientNet-like zoo network at batch
    8 ran in 3.9 ms a call against 6.5 computed channels-first), else ``[batch, channels,
    spatial...]``. With ``computed_once`` (the default) each sum ends in an identity gather
    that keeps XLA from computing it again inside every fusion that reads it, and, channels-last,
    the taps' weights are read from the kernel reordered once to ``[spatial..., channels]``
    (:func:`_computed_once`; the zoo's ConvNeXt at batch 8 went from 19 to 8 and then 5 ms a
    call in one A/B run on the loaded machine). ``module`` itself when it has none; else
    StableHLO bytecode, deterministic like :func:`specialize`.

    Why: XLA's cpu backend (jaxlib 0.10.2) runs a grouped convolution on its Eigen path as
    one dense convolution per group, or on YNNPACK, both 10-200 times slower than PyTorch's
    depthwise kernels at the sizes of MobileNet and EfficientNet layers, while XLA fuses the
    written-out sum into one loop over the output (benchmarks/dwconv_bench.py,
    docs/benchmarks.md). Other grouped convolutions are left as they are."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx, ir.Location.unknown(ctx):
        parsed = _parse(module, ctx)
        found = [(op, shape) for op in _operations(parsed.operation)
                 if op.operation.name == "stablehlo.convolution"
                 and (shape := _depthwise_shape(op.operation)) is not None]
        if not found:
            return module
        for op, shape in found:
            _rewrite_depthwise(op.operation, shape, channels_last, computed_once)
        return bytes(jax_mlir_internal.module_to_bytecode(parsed))


def has_grouped_convolutions(module: bytes) -> bool:
    """Whether ``module`` has a convolution with a ``feature_group_count`` or
    ``batch_group_count`` above 1 (what :func:`rewrite_depthwise_convolutions` may leave)."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        parsed = _parse(module, ctx)
        return any(op.operation.name == "stablehlo.convolution"
                   and (ir.IntegerAttr(op.operation.attributes["feature_group_count"]).value > 1
                        or ir.IntegerAttr(op.operation.attributes["batch_group_count"]).value > 1)
                   for op in _operations(parsed.operation))


def has_convolutions(module: bytes) -> bool:
    """Whether ``module`` has any convolution."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        parsed = _parse(module, ctx)
        return any(op.operation.name == "stablehlo.convolution" for op in _operations(parsed.operation))


# NCHW -> NHWC: a value ``v`` in channels-first order is held as ``transpose(v, _TO_LAST)``; its
# dimension ``d`` is that one's ``_LAST_AT[d]``.
_TO_LAST = (0, 2, 3, 1)
_TO_FIRST = (0, 3, 1, 2)
_LAST_AT = tuple(_TO_LAST.index(d) for d in range(4))
_ELEMENTWISE = frozenset(f"stablehlo.{name}" for name in (
    "add subtract multiply divide maximum minimum power remainder atan2 and or xor negate exponential "
    "exponential_minus_one log log_plus_one logistic rsqrt sqrt cbrt tanh abs sign floor ceil "
    "round_nearest_even round_nearest_afz not convert compare select clamp sine cosine is_finite").split())
_WINDOW_KEYS = ("edge_padding_low", "edge_padding_high", "interior_padding", "start_indices", "limit_indices",
                "strides", "window_dimensions", "window_strides", "base_dilations", "window_dilations")


def _static4(value) -> bool:
    try:
        vtype = ir.RankedTensorType(value.type)
    except ValueError:              # not a ranked tensor (a token, a tuple)
        return False
    return vtype.rank == 4 and vtype.has_static_shape


def _last_type(vtype):
    vtype = ir.RankedTensorType(vtype)
    return ir.RankedTensorType.get([vtype.get_dim_size(d) for d in _TO_LAST], vtype.element_type)


def _channels_first_convolution(op) -> bool:
    dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    return (_static4(op.results[0]) and dims.input_feature_dimension == 1 and dims.output_feature_dimension == 1
            and list(dims.input_spatial_dimensions) == [2, 3] and list(dims.output_spatial_dimensions) == [2, 3])


def channels_last_activations(module: bytes) -> bytes:
    """``module`` with its 2-D convolutions' activations kept channels-last between them: each
    channels-first (NCHW) convolution of ``@main`` takes and gives NHWC, and the elementwise
    ops, pads, slices, concatenations, pooling windows and reductions that read its results run
    on the NHWC values too; a transpose back to NCHW is left only where something else reads a value (the
    results, reshapes, matrix products), and XLA drops those nobody reads. ``module`` itself
    when it has no channels-first 2-D convolution; else StableHLO bytecode, deterministic.

    Why: XLA's cpu convolutions work in NHWC, so an exported PyTorch model (NCHW) had a layout
    change around every convolution, and XLA put each into the fusion of the elementwise ops
    next to it (BatchNorm, SiLU, squeeze-and-excitation), which then read memory across the
    channels' stride, element by element: transformers' EfficientNet-B0 at batch 1 ran 41 ms a
    call against eager PyTorch's 21, and 14 ms once its activations stay NHWC
    (benchmarks/dwconv_bench.py, docs/benchmarks.md). The values are the same; the order of
    the arithmetic is not changed."""
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx, ir.Location.unknown(ctx):
        parsed = _parse(module, ctx)
        block = _main(parsed).regions[0].blocks[0]
        ops = [view.operation for view in block.operations]
        if not any(op.name == "stablehlo.convolution" and _channels_first_convolution(op) for op in ops):
            return module
        last: dict = {}         # a channels-first value -> the same value channels-last

        def channels_last(value, before):
            """``value`` channels-last, made before ``before``: its known form, a broadcast or a
            splat constant made channels-last, else a transpose."""
            if value in last:
                return last[value]
            owner = value.owner
            with ir.InsertionPoint(before):
                if isinstance(owner, (ir.OpView, ir.Operation)):
                    producer = owner.operation
                    if producer.name == "stablehlo.broadcast_in_dim":
                        dims = ir.DenseI64ArrayAttr(producer.attributes["broadcast_dimensions"])
                        return hlo.BroadcastInDimOp(_last_type(value.type), producer.operands[0],
                                                    ir.DenseI64ArrayAttr.get([_LAST_AT[d] for d in dims])).result
                    if producer.name == "stablehlo.constant":
                        attr = ir.DenseElementsAttr(producer.attributes["value"])
                        if attr.is_splat:
                            return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                                _last_type(value.type), attr.get_splat_value())).result
                return hlo.TransposeOp(value, ir.DenseI64ArrayAttr.get(_TO_LAST)).result

        def now_last(op) -> None:
            """``op``'s result, given the channels-last type: a transpose back to channels-first
            for the readers not converted (later converted ones read the result itself)."""
            result = op.results[0]
            result.set_type(_last_type(result.type))
            with ir.InsertionPoint.after(op):
                first = hlo.TransposeOp(result, ir.DenseI64ArrayAttr.get(_TO_FIRST))
            result.replace_all_uses_except(first.result, first.operation)
            last[first.result] = result

        for op in ops:
            name = op.name
            if name == "stablehlo.transpose" and _static4(op.results[0]):
                perm = tuple(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
                source = op.operands[0]
                if source in last and tuple(_TO_FIRST[p] for p in perm) == (0, 1, 2, 3):
                    op.results[0].replace_all_uses_with(last[source])     # back to channels-last
                elif perm == _TO_FIRST and source not in last:
                    last[op.results[0]] = source                          # channels-last already
            elif name == "stablehlo.convolution":
                if not _channels_first_convolution(op):
                    continue
                dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
                op.operands[0] = channels_last(op.operands[0], op)
                op.attributes["dimension_numbers"] = hlo.ConvDimensionNumbers.get(
                    input_batch_dimension=_LAST_AT[dims.input_batch_dimension], input_feature_dimension=3,
                    input_spatial_dimensions=[1, 2],
                    kernel_input_feature_dimension=dims.kernel_input_feature_dimension,
                    kernel_output_feature_dimension=dims.kernel_output_feature_dimension,
                    kernel_spatial_dimensions=list(dims.kernel_spatial_dimensions),
                    output_batch_dimension=_LAST_AT[dims.output_batch_dimension], output_feature_dimension=3,
                    output_spatial_dimensions=[1, 2])
                now_last(op)
            elif name == "stablehlo.reduce":
                # one input (and its init): over channels-last dims, when the dims kept stay in order
                if len(op.operands) != 2 or op.operands[0] not in last:
                    continue
                reduced = list(ir.DenseI64ArrayAttr(op.attributes["dimensions"]))
                kept = [d for d in range(4) if d not in reduced]
                if sorted(kept, key=_LAST_AT.__getitem__) == kept:
                    op.operands[0] = last[op.operands[0]]
                    op.attributes["dimensions"] = ir.DenseI64ArrayAttr.get(sorted(_LAST_AT[d] for d in reduced))
            elif len(op.results) != 1 or not _static4(op.results[0]):
                continue
            elif name in _ELEMENTWISE or name == "stablehlo.concatenate":
                operands = list(op.operands)
                if not any(value in last for value in operands):
                    continue
                for i, value in enumerate(operands):
                    if _static4(value):         # (an elementwise op's scalar operands stay)
                        op.operands[i] = channels_last(value, op)
                if name == "stablehlo.concatenate":
                    op.attributes["dimension"] = ir.IntegerAttr.get(
                        ir.IntegerType.get_signless(64), _LAST_AT[ir.IntegerAttr(op.attributes["dimension"]).value])
                now_last(op)
            elif name in ("stablehlo.pad", "stablehlo.slice", "stablehlo.reduce_window"):
                if op.operands[0] not in last or (name == "stablehlo.reduce_window" and len(op.operands) != 2):
                    continue
                op.operands[0] = last[op.operands[0]]
                for key in _WINDOW_KEYS:
                    if key in op.attributes:
                        values = list(ir.DenseI64ArrayAttr(op.attributes[key]))
                        op.attributes[key] = ir.DenseI64ArrayAttr.get([values[d] for d in _TO_LAST])
                if "padding" in op.attributes:
                    pads = np.asarray(ir.DenseIntElementsAttr(op.attributes["padding"])).reshape(4, 2)
                    op.attributes["padding"] = ir.DenseIntElementsAttr.get(
                        np.ascontiguousarray(pads[list(_TO_LAST)], dtype=np.int64))
                now_last(op)
        return bytes(jax_mlir_internal.module_to_bytecode(parsed))


_RESOURCE_REF = re.compile(r'dense_resource<("(?:[^"\\]|\\.)*"|[^>]+)>')
_RESOURCE_BLOB = re.compile(r'("(?:[^"\\]|\\.)*"|[A-Za-z_$.][\w$.\-]*)\s*:\s*"0x([0-9A-Fa-f]*)"')


def _resource_blobs(module: str) -> dict[str, bytes]:
    """The builtin dialect's resource blobs of a text module (``{-# dialect_resources: { builtin:
    { key: "0x..." } } #-}``), by key, without their leading 4-byte alignment."""
    start = module.find("{-#")
    blobs = {}
    if start >= 0:
        for key, hexed in _RESOURCE_BLOB.findall(module[start:]):
            raw = bytes.fromhex(hexed)
            blobs[key[1:-1] if key.startswith('"') else key] = raw[4:]
    return blobs


def _resource_constants(parsed: ir.Module) -> list[tuple[ir.Operation, str, ir.RankedTensorType]]:
    """Every op (a ``stablehlo.constant``, an ``arith.constant``) whose ``value`` is a
    ``dense_resource`` attribute: (op, resource key, tensor type), in program order."""
    found = []

    def visit(op):
        operation = op.operation if hasattr(op, "operation") else op
        if "value" in operation.attributes:
            attr = operation.attributes["value"]
            text = str(attr)
            if text.startswith("dense_resource<"):
                key = _RESOURCE_REF.match(text).group(1)
                found.append((operation, key[1:-1] if key.startswith('"') else key,
                              ir.RankedTensorType(attr.type)))
        return ir.WalkResult.ADVANCE

    parsed.operation.walk(visit)
    return found


def _resource_array(key: str, blob: bytes | None, ttype: ir.RankedTensorType) -> np.ndarray:
    element = str(ttype.element_type)
    dtype = BY_MLIR.get(element)
    if dtype is None:
        raise ModuleError(f"dense_resource {key!r} holds {element}, which no bundle tensor can hold")
    if blob is None:
        raise ModuleError(f"dense_resource {key!r} is used but the module carries no blob for it")
    shape = [ttype.get_dim_size(i) for i in range(ttype.rank)]
    count = int(np.prod(shape, dtype=np.int64))
    if len(blob) != count * dtype.numpy.itemsize:
        raise ModuleError(f"dense_resource {key!r} has {len(blob)} bytes, {ttype} needs"
                          f" {count * dtype.numpy.itemsize}")
    return np.frombuffer(blob, dtype=dtype.numpy).reshape(shape).copy()


def dense_resources(module: str) -> dict[str, np.ndarray]:
    """The value of every ``dense_resource`` constant of a StableHLO text module, by resource
    key: the blob the module carries, as an array of the constant's type."""
    blobs = _resource_blobs(module)
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx:
        parsed = _parse(module.encode(), ctx)
        return {key: _resource_array(key, blobs.get(key), ttype)
                for _, key, ttype in _resource_constants(parsed)}


def _dense_attr(array: np.ndarray, ttype: ir.RankedTensorType):
    """``array`` as an inline ``dense<...>`` attribute of type ``ttype``."""
    if array.dtype == BY_MLIR["bf16"].numpy:
        array = array.view(np.uint16)           # the bindings take bf16 as its bits
    return ir.DenseElementsAttr.get(np.ascontiguousarray(array), type=ttype.element_type,
                                    shape=list(array.shape))


def resolve_dense_resources(module: str, arguments: Sequence[np.ndarray] = (), at: int = 0) -> str:
    """``module`` (StableHLO text) with no ``dense_resource`` constant left, which XLA refuses
    ("Only dense elements attr are supported"): torch-mlir writes every literal tensor of more
    than one element that way, its bytes in a blob at the end of the text.

    ``@main`` gets one new argument for each of ``arguments`` (every one, used or not, so that
    every module of a bundle takes the same weights), inserted from index ``at`` on (after the
    weights it already takes, before its inputs); a constant of ``@main`` whose value is one of
    them (dtype, shape and bytes) reads that argument instead. Every other ``dense_resource``
    constant becomes an inline ``dense<...>`` constant holding the same value. Returns the text
    module, printed without the blobs; ``module`` itself when there is nothing to do."""
    if "dense_resource<" not in module and not arguments:
        return module
    blobs = _resource_blobs(module)
    wanted = {(a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()): i for i, a in enumerate(arguments)}
    with _context_lock, jax_mlir_internal.make_ir_context() as ctx, ir.Location.unknown(ctx):
        parsed = _parse(module.encode(), ctx)
        main = _main(parsed)
        block = main.regions[0].blocks[0]
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        inputs = list(ftype.inputs)
        if not 0 <= at <= len(inputs):
            raise ModuleError(f"@main takes {len(inputs)} argument(s); cannot insert at {at}")
        new_arguments = []
        if arguments:
            # Block arguments can only be appended: append the new ones, then every argument
            # that must follow them again, and drop the originals.
            for array in arguments:
                element = next((d.mlir for d in BY_MLIR.values() if d.numpy == array.dtype), None)
                if element is None:
                    raise ModuleError(f"an argument of dtype {array.dtype} cannot be passed to a module")
                ttype = ir.RankedTensorType.get(list(array.shape), ir.Type.parse(element))
                new_arguments.append(block.add_argument(ttype, ir.Location.unknown()))
            moved = list(block.arguments)[at:len(inputs)]
            for old in moved:
                again = block.add_argument(old.type, ir.Location.unknown())
                old.replace_all_uses_with(again)
            for index in reversed(range(at, len(inputs))):
                block.erase_argument(index)
            inputs[at:at] = [a.type for a in new_arguments]
            main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, ftype.results))
            if "arg_attrs" in main.attributes:
                attrs = list(ir.ArrayAttr(main.attributes["arg_attrs"]))
                attrs[at:at] = [ir.DictAttr.get({}) for _ in new_arguments]
                main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        for op, key, ttype in _resource_constants(parsed):
            array = _resource_array(key, blobs.get(key), ttype)
            index = wanted.get((array.dtype.str, array.shape, array.tobytes()))
            in_main = op.parent is not None and op.parent.operation == main.operation
            if index is not None and in_main:
                op.results[0].replace_all_uses_with(new_arguments[index])
                op.erase()
            else:
                op.attributes["value"] = _dense_attr(array, ttype)
        return parsed.operation.get_asm()


def _tensor_type(t) -> TensorType:
    try:
        rt = ir.RankedTensorType(t)
    except ValueError:
        raise ModuleError(f"@main uses {t}, but only ranked tensors are supported") from None
    shape = tuple(None if rt.is_dynamic_dim(i) else rt.get_dim_size(i) for i in range(rt.rank))
    return TensorType(shape, str(rt.element_type))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return re.sub(r"\s+", " ", text)[:300] or type(exc).__name__


@functools.cache
def host_cpu_features() -> str:
    """This host's machine and instruction-set extensions, as a short digest: the ``flags`` (x86)
    or ``Features`` (Arm) line of ``/proc/cpuinfo``, sorted; the machine name alone where there
    is no such file. Two hosts that can run each other's XLA cpu code give the same digest."""
    features = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    features = " ".join(sorted(set(value.split())))
                    break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}\n{features}".encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class CompiledMemory:
    """What XLA says an executable needs, in bytes."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int


# XLA options xlaserve compiles with, per backend (``CompileOptions.env_option_overrides``: they
# win over the same flags in ``XLA_FLAGS``). On the cpu, YNNPACK runs dots only: XLA's default
# also hands it each convolution, which made ResNet-18 cost 75-85 ms of CPU a call at batch 1
# against 45-47 without (benchmarks/resnet_exec_bench.py, docs/benchmarks.md), while dots
# (the ``mlp`` example at batch 32) lose about 40% without it.
_YNN_FUSION = "xla_cpu_experimental_ynn_fusion_type"
_YNN_DOTS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
COMPILE_OVERRIDES: Mapping[str, tuple[tuple[str, str], ...]] = {
    "cpu": ((_YNN_FUSION, _YNN_DOTS),),
}

#: The name of the compile options :data:`COMPILE_OVERRIDES` gives.
DEFAULT_CHOICE = "default"

# Other compile options a module may be compiled with, per backend, by name: a module with
# grouped convolutions left after :func:`rewrite_depthwise_convolutions` (ResNeXt's, say) is
# compiled with each and with the default, and the fastest on trial runs is kept
# (:mod:`xlaserve.runtime.tuning`). On the cpu YNNPACK also taking convolutions runs a ResNeXt
# block at batch 8 in half the time of XLA's own path, at batch 1 about 17% faster
# (benchmarks/dwconv_bench.py, docs/benchmarks.md), while it slows ResNet-18's dense ones.
# ``xla-defaults`` sets nothing: XLA's own choice of what YNNPACK takes, as ``jax.jit`` compiles;
# it ran the Flax MNIST CNN at batch 8 in 1.3 ms against 1.9 with the server's default (the
# same module, docs/export.md), while it is the setting that made ResNet-18 slower.
COMPILE_CHOICES: Mapping[str, Mapping[str, tuple[tuple[str, str], ...]]] = {
    "cpu": {"ynn-convolutions": ((_YNN_FUSION, _YNN_DOTS + ",LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"),),
            "xla-defaults": ()},
}


# The batched copy of jax.Arrays that jax.device_put ends in (jax 0.10.2); None where a jax
# release lacks it (then jax.device_put is used).
_batched_copy = getattr(xla_client, "batched_copy_array_to_devices_with_sharding", None)
_ALWAYS_COPY = getattr(getattr(xla_client, "ArrayCopySemantics", None), "ALWAYS_COPY", None)
_ArrayImpl = getattr(_jax, "ArrayImpl", None)


@functools.lru_cache(maxsize=4096)
def _aval(shape: tuple[int, ...], dtype: np.dtype):
    """The abstract value of a weight or an input (cached: the same few shapes are loaded and
    put again and again)."""
    return jax_core.ShapedArray(shape, dtype)


def weights_signature(host) -> tuple:
    """What a weight pool's slot must match to take ``host``: each tensor's shape and dtype."""
    return tuple([(a.shape, a.dtype) for a in host])


def _forget_values(arrays) -> None:
    """New bytes were copied under ``arrays``: drop any NumPy value jax cached from the old ones."""
    for array in arrays:
        if getattr(array, "_npy_value", None) is not None:
            array._npy_value = None


def _sources_and_targets(host, views, span, extent) -> tuple[tuple, tuple]:
    """What a load copies: the host copy's one span into the extent's, when both are known
    (their tensors lie alike: the signature matched), else tensor by tensor."""
    if span is not None and extent is not None and len(span) <= len(extent):
        return (span,), (extent[:len(span)],)
    return tuple(host), tuple(views)


def _copy_in_chunks(host, targets, step_bytes: int):
    """Copy each of ``host`` into the same-shaped array of ``targets``, yielding between chunks
    of about ``step_bytes`` (never before the first or after the last)."""
    since = 0                           # bytes copied since the last step
    for src, dst in zip(host, targets):
        if src.nbytes > step_bytes and src.flags.c_contiguous:
            flat_src, flat_dst = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
            for at in range(0, src.nbytes, step_bytes):
                if since:
                    since = 0
                    yield
                flat_dst[at:at + step_bytes] = flat_src[at:at + step_bytes]
                since = min(step_bytes, src.nbytes - at)
        else:
            if since and since + src.nbytes > step_bytes:
                since = 0
                yield
            np.copyto(dst, src)
            since += src.nbytes


class Device:
    """One PJRT device (``cpu`` or ``cuda``) and the client that owns it.

    Every method that runs or copies blocks; callers run them off the Trio thread.
    """

    def __init__(self, backend: str, ordinal: int = 0) -> None:
        self.backend = backend
        self._client = jax_backend.get_backend(backend)
        devices = self._client.local_devices()
        if ordinal >= len(devices):
            raise RuntimeError(f"{backend} has {len(devices)} device(s); ordinal {ordinal} does not exist")
        self._device = devices[ordinal]
        self._device_list = xla_client.DeviceList((self._device,))
        self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        self._device_memory: jax.sharding.Sharding | None = None    # memory_kind="device", made once
        self._host_memory_kind: str | None = None

    @property
    def kind(self) -> str:
        return str(self._device.device_kind)

    @property
    def platform_version(self) -> str:
        return str(self._client.platform_version)

    def memory_bytes(self) -> int | None:
        """The device allocator's limit (``bytes_limit``): on cuda the BFC pool, that is
        ``memory_fraction`` of the device's memory (see :func:`cuda_client_options`); None where
        the allocator does not say (cpu)."""
        stats = self._device.memory_stats()
        return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None

    @property
    def permutes_kernels(self) -> bool:
        """Whether modules should take convolution-kernel weights (and weights read only
        transposed) pre-permuted (:func:`kernel_permutations`, :func:`relayout`): on the cpu,
        which otherwise transposes them on every call (measured). Left off on cuda, where it was
        not measured."""
        return self.backend == "cpu"

    @property
    def rewrites_depthwise(self) -> bool:
        """Whether modules should have their depthwise convolutions written out
        (:func:`rewrite_depthwise_convolutions`) before they are compiled: on the cpu, where XLA's
        own grouped convolutions are 10-200 times slower (measured). Left off on cuda, where it
        was not measured."""
        return self.backend == "cpu"

    def compile(self, module: bytes, choice: str = DEFAULT_CHOICE):
        """Compile a StableHLO module (text, bytecode or portable artifact) for this device,
        with the compile options ``choice`` names: this backend's :data:`COMPILE_OVERRIDES`
        (``default``) or one of its :data:`COMPILE_CHOICES`."""
        return self._client.compile_and_load(module, self._device_list, self._compile_options(choice))

    def overrides(self, choice: str = DEFAULT_CHOICE) -> tuple[tuple[str, str], ...]:
        """The XLA options ``choice`` sets on this backend. ValueError for a name it does not have."""
        if choice == DEFAULT_CHOICE:
            return tuple(COMPILE_OVERRIDES.get(self.backend, ()))
        found = COMPILE_CHOICES.get(self.backend, {}).get(choice)
        if found is None:
            raise ValueError(f"no compile options named {choice!r} on {self.backend} (it has "
                             f"{', '.join((DEFAULT_CHOICE, *COMPILE_CHOICES.get(self.backend, {})))})")
        return tuple(found)

    def compile_choices(self, module: bytes) -> tuple[str, ...]:
        """The compile options worth trying on ``module``, the default first: all of this
        backend's :data:`COMPILE_CHOICES` when the module has convolutions (which path runs
        them fastest differs from model to model), else the default alone."""
        others = tuple(COMPILE_CHOICES.get(self.backend, {}))
        if others and has_convolutions(module):
            return (DEFAULT_CHOICE, *others)
        return (DEFAULT_CHOICE,)

    @staticmethod
    def trial_arguments(module: bytes, seed: int = 0) -> list[np.ndarray]:
        """Arguments for trial runs of ``module`` (static shapes): small standard-normal values
        for floating-point arguments, zeros for the others (integers index tables, so zeros stay
        in range)."""
        rng = np.random.default_rng(seed)
        arguments = []
        for index, t in enumerate(read_signature(module).inputs):
            if any(d is None for d in t.shape) or t.element not in BY_MLIR:
                raise ModuleError(f"argument {index} of @main is {t}, which a trial run cannot make")
            dtype = BY_MLIR[t.element].numpy
            if np.issubdtype(dtype, np.floating) or t.element in ("bf16", "f16"):
                arguments.append((rng.standard_normal(t.shape) * 0.1).astype(dtype))
            else:
                arguments.append(np.zeros(t.shape, dtype))
        return arguments

    def _compile_options(self, choice: str = DEFAULT_CHOICE):
        options = xla_client.CompileOptions()
        overrides = self.overrides(choice)
        if overrides:
            options.env_option_overrides = list(overrides)
        return options

    @staticmethod
    def compiled_memory(executable) -> CompiledMemory:
        stats = executable.get_compiled_memory_stats()
        return CompiledMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                              int(stats.temp_size_in_bytes), int(stats.generated_code_size_in_bytes))

    def serialize(self, executable) -> bytes:
        return bytes(self._client.serialize_executable(executable))

    def deserialize(self, blob: bytes, choice: str = DEFAULT_CHOICE):
        """An executable :meth:`serialize` wrote, compiled with the options ``choice`` names."""
        return self._client.deserialize_executable(blob, self._device_list, self._compile_options(choice))

    def cache_key_parts(self) -> dict[str, str]:
        """What, besides the module bytes, decides whether a serialized executable fits this
        device: versions, backend, device kind and the compile options :meth:`compile` uses
        (the default and every choice a trial may pick)."""
        options = hashlib.sha256(self._compile_options().SerializeAsString())
        for name in COMPILE_CHOICES.get(self.backend, {}):
            options.update(f"\0{name}\0".encode())
            options.update(self._compile_options(name).SerializeAsString())
        parts = {"jax": JAX_VERSION, "jaxlib": JAXLIB_VERSION, "backend": self.backend, "device_kind": self.kind,
                 "platform_version": self.platform_version, "compile_options": options.hexdigest()}
        if self.backend == "cpu":
            # XLA's cpu code is compiled for this host's instruction set: an entry written on a
            # host with AVX-512 (a cache_dir on a shared home directory) would stop a worker on
            # one without it with SIGILL, so the host's set is part of the key
            parts["cpu_features"] = host_cpu_features()
        return parts

    @property
    def host_memory_kind(self) -> str:
        """Where :meth:`host_store` keeps weights: ``pinned_host`` (page-locked, DMA-able) when
        the device offers that memory kind and is not the cpu, else ``numpy``."""
        if self._host_memory_kind is None:
            kinds = {m.kind for m in self._device.addressable_memories()}
            self._host_memory_kind = ("pinned_host" if self.backend != "cpu" and "pinned_host" in kinds
                                      else "numpy")
        return self._host_memory_kind

    @property
    def transfers_async(self) -> bool:
        """Whether a load from :meth:`host_store`'s copy is a DMA that :meth:`start_weights`
        only enqueues (returning at once), to be waited for separately: on a GPU with
        page-locked host memory."""
        return self.host_memory_kind == "pinned_host"

    def host_store(self, arrays) -> tuple:
        """The host copy of a model's weights. On a GPU with page-locked host memory the arrays
        are copied into it once (``memory_kind="pinned_host"``) so that every later load is a
        DMA; elsewhere the NumPy arrays (a private copy read from the file) are kept as they are."""
        if self.host_memory_kind != "pinned_host" or not arrays:
            return tuple(arrays)
        pinned = jax.sharding.SingleDeviceSharding(self._device, memory_kind="pinned_host")
        with jax.enable_x64(True):      # keep i64/f64 weights 64-bit, as the module takes them
            out = jax.device_put(list(arrays), pinned)
        jax.block_until_ready(out)
        return tuple(out)

    def put_weights(self, host) -> tuple:
        """Copy a model's host weights onto the device in one batched transfer and wait for it,
        into memory of its own (fresh buffers): for a transient copy outside the weight cache
        (:meth:`load_weights` is the cache's path). Every dtype is kept exactly: an i64 or f64
        weight (a PyTorch buffer such as BatchNorm's ``num_batches_tracked``) stays 64-bit, as
        the module takes it, whatever JAX's ``jax_enable_x64`` says (with it off ``device_put``
        would make it 32-bit and the module would refuse the buffer). The result never aliases
        host memory (on cpu, ``device_put`` would otherwise wrap aligned NumPy memory in place,
        making the "device copy" free and the budget fiction)."""
        if not host:
            return ()
        if self.backend == "cpu":
            # may_alias=False is not enough: the cpu client still wraps page-aligned host memory
            # (measured with jax 0.10.2). Copy into fresh buffers, which the arrays then own.
            fresh = [np.empty_like(a) for a in host]
            for dst, src in zip(fresh, host):
                np.copyto(dst, src)
            with jax.enable_x64(True):
                out = jax.device_put(fresh, self._device)
            jax.block_until_ready(out)
            return tuple(out)
        return self.wait_weights(self.start_weights(host))

    @property
    def pools_weights(self) -> bool:
        """Whether the weight cache should give :meth:`load_weights` a
        :class:`~xlaserve.runtime.pool.WeightPool`: on cpu, where device memory is host memory
        and the client wraps it without a copy. On cuda the device allocator is already a pool
        (XLA's BFC allocator, sized once: :func:`cuda_client_options`)."""
        return self.backend == "cpu"

    def load_weights(self, host, pool=None) -> tuple:
        """A model's weights on the device, in binding order, ready to use: the weight cache's
        load. On cpu with ``pool`` (a :class:`~xlaserve.runtime.pool.WeightPool`): see
        :meth:`load_weights_in_steps`, run to the end. Elsewhere: one batched transfer
        (:meth:`start_weights`), waited for. Dtypes are kept exactly, as :meth:`put_weights`."""
        if not host:
            return ()
        if pool is None or not self.pools_weights:
            return self.put_weights(host) if self.backend == "cpu" else self.wait_weights(self.start_weights(host))
        steps = self.load_weights_in_steps(host, pool, 1 << 62)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def load_weights_in_steps(self, host, pool, step_bytes: int, span=None, signature: tuple | None = None,
                              reuse: bool = True):
        """A generator that loads a model's weights into ``pool`` (cpu only; see
        :attr:`pools_weights`), yielding between chunks of about ``step_bytes`` copied (never
        before the first or after the last), and returns the device arrays
        (``StopIteration.value``). An idle slot of the pool with the same shapes and dtypes
        (:class:`~xlaserve.runtime.pool.Slot`) is copied into and its arrays returned as they
        are; otherwise one new extent holds the model, each tensor is copied into it (memory an
        earlier load already mapped) and wrapped as a device buffer without another copy, and
        the extent is kept as a slot. ``span``: the host copy's bytes when its tensors lie as
        the extent's do (:func:`~xlaserve.runtime.pool.packed_span`): then the copy is of that
        one span, not a tensor at a time. ``signature``: :func:`weights_signature` of ``host`` if
        the caller has it; ``reuse=False`` when it has just looked for an idle slot
        (:meth:`load_weights_into_slot`) and found none: the pool is not searched again. Closing
        the generator early leaves the slot idle (its bytes half written: nothing reads an idle
        slot). The steps let a caller on an event loop copy a large model without a thread hop
        and without holding the loop for the whole copy."""
        if signature is None:
            signature = weights_signature(host)
        slot = pool.reuse(signature) if reuse else None
        if slot is None:
            lease = pool.lease([a.nbytes for a in host])
            try:
                views = tuple(lease.array(src.dtype, src.shape) for src in host)
                extent = lease.span()
            finally:
                lease.seal()            # the views hold the extent from here
            yield from _copy_in_chunks(*_sources_and_targets(host, views, span, extent), step_bytes)
            arrays = tuple(_jax.batched_device_put(_aval(v.shape, v.dtype), self._sharding, [v], [self._device],
                                                   True, False, _jax.HostBufferSemantics.ZERO_COPY, enable_x64=True)
                           for v in views)
            slot = pool.keep(signature, arrays, views, extent)
            del arrays, views, extent
            return pool.done(slot)
        try:
            yield from _copy_in_chunks(*_sources_and_targets(host, slot.views, span, slot.span), step_bytes)
            _forget_values(slot.arrays)
        finally:
            arrays = pool.done(slot)
        return arrays

    def load_weights_into_slot(self, host, pool, signature: tuple, span=None) -> tuple | None:
        """A catalog's usual load on cpu, at once: ``host`` copied into an idle slot of ``pool``
        whose shapes and dtypes are ``signature`` (:func:`weights_signature`), and the slot's
        arrays returned; None, with nothing done, when no slot of ``signature`` is idle. For a
        model small enough to copy without steps: no generator; one ``copyto`` of ``span``
        (see :meth:`load_weights_in_steps`), else one a tensor."""
        slot = pool.reuse(signature)
        if slot is None:
            return None
        try:
            for src, dst in zip(*_sources_and_targets(host, slot.views, span, slot.span)):
                np.copyto(dst, src)
            _forget_values(slot.arrays)
        finally:
            arrays = pool.done(slot)
        return arrays

    def start_weights(self, host) -> tuple:
        """Start copying a model's host weights onto the device as one batched, asynchronous
        transfer; the arrays returned can be passed to an execution at once (PJRT orders it
        after the copy) or waited for with :meth:`wait_weights`. Meant for cuda, where
        :meth:`host_store` keeps the weights in page-locked memory, so the copy is a DMA that
        the host thread does not perform."""
        target = self._device_memory
        if target is None:
            target = self._device_memory = jax.sharding.SingleDeviceSharding(self._device, memory_kind="device")
        host = list(host)
        if (_batched_copy is not None and _ALWAYS_COPY is not None
                and all(type(a) is _ArrayImpl and a.sharding.device_set == {self._device} for a in host)):
            # page-locked host arrays of this device (host_store): the one batched call that
            # jax.device_put ends in, without its Python layers per array (tens of us each)
            n = len(host)
            return tuple(_batched_copy(host, [self._device_list] * n, [target] * n, [_ALWAYS_COPY] * n))
        with jax.enable_x64(True):
            return tuple(jax.device_put(host, target, may_alias=False))

    @staticmethod
    def weights_ready(arrays: tuple) -> bool:
        """Whether the copies :meth:`start_weights` started are done (or failed: then
        :meth:`wait_weights` raises), without blocking."""
        return all(a.is_ready() for a in arrays)

    @staticmethod
    def wait_weights(arrays: tuple) -> tuple:
        """Block until the copies :meth:`start_weights` started are done; returns ``arrays``."""
        jax.block_until_ready(arrays)
        return arrays

    @staticmethod
    def collect_garbage() -> None:
        """Release now the host memory that device arrays collected since jax's last call
        wrapped: jaxlib defers those releases to its next call (measured with jax 0.10.2), and a
        :class:`~xlaserve.runtime.pool.WeightPool` reuses memory only once it is released."""
        _jax.collect_garbage()

    @staticmethod
    def shares_memory(device_array, host: np.ndarray) -> bool:
        """Whether a device array's buffer is ``host``'s memory (cpu aliasing check, for tests)."""
        return device_array.unsafe_buffer_pointer() == host.ctypes.data

    def memory_in_use(self) -> int | None:
        """Bytes the device allocator holds, or None where it does not say (cpu)."""
        stats = self._device.memory_stats()
        return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None

    def execute(self, executable, arguments: list) -> list[np.ndarray]:
        """Run once and return the outputs on the host. NumPy arrays among ``arguments`` are
        put on the device first (on cpu without a copy where PJRT can alias them)."""
        device_args = [a if isinstance(a, jax.Array) else self._put(a) for a in arguments]
        results = executable.execute_sharded(device_args)
        return [np.asarray(shards[0]) for shards in results.disassemble_into_single_device_arrays()]

    def _put(self, host: np.ndarray):
        """``host`` on the device, as ``jax.device_put`` would put it but without its Python
        layers (about 8 µs instead of 80 per array). The dtype is kept exactly (no x64
        canonicalization): the executable was compiled for the manifest's dtypes. The abstract
        value is made once per shape and dtype (:func:`_aval`; building one costs about as much
        as the put)."""
        return _jax.batched_device_put(_aval(host.shape, host.dtype), self._sharding, [host], [self._device], True,
                                       enable_x64=True)

    def defragment(self) -> bool:
        """Compact device memory where the backend can; False where there is nothing to do."""
        if self.backend == "cpu":
            return False
        self._client.defragment()
        return True
