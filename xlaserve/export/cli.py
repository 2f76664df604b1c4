"""``xlaserve export``: a JAX function and its parameters, a Flax model, or a PyTorch model,
from a Python module, as a verified bundle.

    xlaserve export mypkg.model:forward --params init_params \\
        --input image:uint8:224,224,3:cwhn --batch-sizes 1,4,16 --out models/classifier
    xlaserve export --torch mypkg.model:build --input image:float32:3,224,224:whcn \\
        --batch-sizes 1,4,16 --out models/classifier

The function is ``forward(params, *inputs)``; ``--params`` names a function returning the
parameter pytree (or the pytree itself). A Flax model object in its place (or, with ``--flax``,
a function returning one) is exported through :mod:`xlaserve.export.from_flax`, ``--params`` then
naming a Linen model's variables. ``--torch`` names a function returning the
``torch.nn.Module`` (or the module). The work is :func:`xlaserve.export.from_jax.export_jax` or
:func:`xlaserve.export.from_torch.export_torch` (imported only for ``--torch``); this module parses
the command line into their arguments and reports what they did.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("xlaserve.export")

# The manifest's batch letter (xlaserve.manifest.BATCH_AXIS), restated so that building the
# command's parser imports no NumPy.
BATCH_AXIS = "n"

_AXES = re.compile(r"[a-z]+")


class UsageError(ValueError):
    """A command-line value that cannot be used; the message names the flag."""


def parse_input(text: str):
    """``NAME:DTYPE:SHAPE[:AXES]`` as a :class:`~xlaserve.export.TensorSpec` and a note when the
    axes were defaulted (else None).

    SHAPE is the row-major shape of one sample, without the batch axis, sizes separated by ``,``
    or ``x`` (``224,224,3``; empty for one scalar per sample). AXES names every axis, batch ``n``
    included, fastest-varying first (``cwhn``); without it the axes get
    :func:`~xlaserve.export.from_jax.default_axes` and the batch is row-major axis 0.
    """
    from xlaserve.export.spec import TensorSpec
    from xlaserve.export.from_jax import default_axes

    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[0]:
        raise UsageError(f"--input {text!r}: expected NAME:DTYPE:SHAPE[:AXES], e.g. image:uint8:224,224,3:cwhn")
    name, dtype, shape_text = parts[:3]
    try:
        sizes = [int(d) for d in re.split(r"[,x]", shape_text)] if shape_text else []
    except ValueError:
        raise UsageError(f"--input {text!r}: SHAPE {shape_text!r} must be sizes separated by ','"
                         " (row-major, one sample, without the batch axis), e.g. 224,224,3") from None
    if any(d < 0 for d in sizes):
        raise UsageError(f"--input {text!r}: SHAPE {shape_text!r} has a negative size")
    note = None
    if len(parts) == 4:
        axes = parts[3]
        if not _AXES.fullmatch(axes):
            raise UsageError(f"--input {text!r}: AXES {axes!r} must be lowercase letters, one per axis,"
                             f" fastest first, '{BATCH_AXIS}' for the batch (e.g. cwhn)")
        others = [c for c in reversed(axes) if c != BATCH_AXIS]
        if len(others) != len(sizes):
            raise UsageError(f"--input {text!r}: AXES {axes!r} names {len(others)} non-batch axes,"
                             f" SHAPE {shape_text!r} has {len(sizes)}")
    else:
        axes = default_axes(len(sizes))
        note = (f"input {name!r}: axes not given, named {axes!r} (fastest first, batch first in"
                f" row-major order); add :AXES to --input to choose")
    dims = dict(zip([c for c in reversed(axes) if c != BATCH_AXIS], sizes))
    try:
        return TensorSpec(name, dtype, axes, dims), note
    except ValueError as exc:
        raise UsageError(f"--input {text!r}: {exc}") from None


def parse_output(text: str) -> tuple[str, str | None]:
    """``NAME[:AXES]``: an output's name and, optionally, its axes."""
    name, _, axes = text.partition(":")
    if not name or (axes and not _AXES.fullmatch(axes)):
        raise UsageError(f"--output {text!r}: expected NAME or NAME:AXES (AXES lowercase letters, e.g. xn)")
    return name, axes or None


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes {text!r}: expected positive integers separated by ',', e.g. 1,4,16") from None
    if not sizes or any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
        raise UsageError(f"--batch-sizes {text!r}: expected distinct positive integers, e.g. 1,4,16")
    return sizes


def _import_module(spec: str, flag: str) -> ModuleType:
    """A dotted module name (importable from the current directory) or a ``.py`` file path."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec).resolve()
        if not path.is_file():
            raise UsageError(f"{flag}: {spec} is not a file")
        # As `python path/to/model.py` would: its directory is importable (for its sibling
        # modules). Its module name must not shadow one already imported (a model.py, a json.py).
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        name = path.stem if path.stem not in sys.modules else f"_xlaserve_export_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise UsageError(f"{flag}: importing {spec} raised {describe(exc)}") from None
        return module
    if "" not in sys.path:               # `python -m` would find the user's package here too
        sys.path.insert(0, "")
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        raise UsageError(f"{flag}: cannot import {spec!r}: {exc}") from None
    except Exception as exc:
        raise UsageError(f"{flag}: importing {spec!r} raised {describe(exc)}") from None


def one_line(text: str, limit: int = 2000) -> str:
    """``text`` with every run of whitespace, newlines included, made one space; cut at
    ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


# Frames in these directories are the libraries' and Python's own, not the user's code.
_LIBRARY_DIRS = tuple({str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"],
                                                       sysconfig.get_paths()["purelib"],
                                                       sysconfig.get_paths()["platlib"],
                                                       Path(__file__).parent)})


def where(exc: BaseException) -> str | None:
    """Where ``exc`` was raised, as ``FILE:LINE in FUNCTION``: the innermost frame of its
    traceback in the user's code (outside Python's library, installed packages and xlaserve),
    else the innermost frame; None without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_LIBRARY_DIRS)]
    frame = (own or frames)[-1]
    if not own and str(Path(frame.filename).resolve()).startswith(str(Path(__file__).parent.resolve())):
        return None                      # raised by xlaserve itself: its message says where
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def describe(exc: BaseException) -> str:
    """``ValueError: message (at FILE:LINE in FUNCTION)``, on one line."""
    at = where(exc)
    return one_line(f"{type(exc).__name__}: {exc}" + (f" (at {at})" if at else ""))


def resolve(target: str, flag: str, default_module: ModuleType | None = None) -> tuple[ModuleType, Any]:
    """``MODULE:NAME`` (or ``NAME`` alone, in ``default_module``) as (module, attribute)."""
    module_spec, colon, attr = target.rpartition(":")
    if not colon and default_module is None:
        raise UsageError(f"{flag} {target!r}: expected MODULE:NAME, e.g. mypkg.model:forward or model.py:forward")
    module = _import_module(module_spec, flag) if module_spec else default_module
    if module is None or not attr.isidentifier() or not hasattr(module, attr):
        where = module.__name__ if module is not None else module_spec
        raise UsageError(f"{flag} {target!r}: {where} has no attribute {attr!r}")
    return module, getattr(module, attr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("function", metavar="MODULE:FUNCTION", nargs="?",
                   help="the JAX function fn(params, *inputs): a dotted module importable from here, or a .py file")
    p.add_argument("--torch", metavar="MODULE:FACTORY",
                   help="export a PyTorch model instead of a JAX function: a function returning the "
                        "torch.nn.Module (called with no arguments), or the module; --input lists forward's "
                        "tensors. Needs pip install 'xlaserve[export-torch]'")
    p.add_argument("--params", metavar="[MODULE:]NAME",
                   help="a function returning the parameter pytree (called with no arguments), or the pytree; "
                        "NAME alone is looked up in the function's module. Default: no parameters (fn(None, ...))")
    p.add_argument("--input", action="append", required=True, metavar="NAME:DTYPE:SHAPE[:AXES]",
                   help="one per input, in fn's argument order: SHAPE row-major per sample without the batch "
                        "(224,224,3), AXES fastest first with n for the batch (cwhn); default axes xyz..n")
    p.add_argument("--output", action="append", metavar="NAME[:AXES]",
                   help="names the outputs in order (all of them); default: output, the returned dict's keys, "
                        "or output0, output1...")
    p.add_argument("--batch-sizes", required=True, help="compiled batch sizes, e.g. 1,4,16")
    p.add_argument("--out", required=True, help="the bundle directory; its name is the model name")
    p.add_argument("--atol", type=float, help="absolute tolerance of the verification (default per dtype)")
    p.add_argument("--rtol", type=float, help="relative tolerance of the verification (default per dtype)")
    p.add_argument("--seed", type=int, default=0, help="seed of the verification's random inputs (default 0)")
    p.add_argument("--no-verify", action="store_true", help="write the bundle without running it")
    p.add_argument("--bytecode", action="store_true", help="write .mlirbc portable artifacts instead of text")
    p.add_argument("--hooks", action="store_true", help="also write a pass-through model.py to start hooks from")
    p.add_argument("--flax", action="store_true",
                   help="MODULE:FUNCTION is a function returning a Flax model (NNX, or Linen with --params naming "
                        "its variables), called with no arguments; a Flax model object is recognised without it")
    p.add_argument("--dynamic-batch", action="store_true",
                   help="write one module with a symbolic batch size, model.mlir, which the server specializes to "
                        "every size of --batch-sizes, instead of one module per size")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Exit status 0: written (and verified); 1: written, but the verification failed (or the
    written bundle did not load); 2: anything else (a mistake on the command line, in the
    function or model factory, or an export that failed), nothing written. Every failure is one
    line on stderr naming what went wrong and where."""
    from xlaserve.errors import BundleError
    from xlaserve.export.spec import ExportError, TracingError
    from xlaserve.export.from_jax import export_jax
    from xlaserve.export.verify import VerificationError
    from xlaserve.progress import ProgressReport

    try:
        if (args.function is None) == (args.torch is None):
            raise UsageError("give either MODULE:FUNCTION (a JAX function) or --torch MODULE:FACTORY"
                             " (a PyTorch model), not both or neither")
        if args.torch is not None:
            for flag, given in (("--params", args.params), ("--bytecode", args.bytecode),
                                ("--flax", args.flax), ("--dynamic-batch", args.dynamic_batch)):
                if given:
                    raise UsageError(f"{flag} does not apply to --torch (the weights are the module's"
                                     " state_dict; the modules are StableHLO text, one per batch size)")
            export_torch, model = _torch_source(args.torch)
        else:
            module, fn = resolve(args.function, "MODULE:FUNCTION")
            if not callable(fn):
                raise UsageError(f"{args.function}: not a function")
            params = None
            if args.params:
                _, params = resolve(args.params, "--params", module)
                if callable(params):
                    try:
                        params = params()
                    except Exception as exc:
                        raise UsageError(f"--params {args.params}: calling it raised {describe(exc)}") from None
            fn, params = _flax_source(args, fn, params)
        parsed = [parse_input(text) for text in args.input]
        outputs = [parse_output(text) for text in args.output or []]
        sizes = parse_batch_sizes(args.batch_sizes)
        for atol_or_rtol in (args.atol, args.rtol):
            if atol_or_rtol is not None and not atol_or_rtol >= 0:
                raise UsageError(f"--atol/--rtol {atol_or_rtol}: expected a number >= 0")
    except UsageError as exc:
        print(f"xlaserve export: {one_line(str(exc))}", file=sys.stderr)
        return 2
    progress = ProgressReport(log)          # a bar under the lines on a terminal
    for _, note in parsed:
        if note:
            progress(f"note: {note}")
    common = dict(inputs=[spec for spec, _ in parsed], compiled_batch_sizes=sizes,
                  output_names=[name for name, _ in outputs] or None,
                  output_axes={name: axes for name, axes in outputs if axes},
                  hooks=args.hooks, verify=not args.no_verify, atol=args.atol, rtol=args.rtol,
                  seed=args.seed, progress=progress)
    try:
        try:
            if args.torch is not None:
                result = export_torch(args.out, model, **common)
            else:
                result = export_jax(args.out, fn, params, bytecode=args.bytecode,
                                    dynamic_batch=args.dynamic_batch, **common)
        finally:
            progress.close()
    except (VerificationError, BundleError) as exc:
        # Written, then failed when run or loaded as the server would (BundleError: a module that
        # disagrees with its manifest or weights, or that XLA does not compile).
        found = exc.summary() if isinstance(exc, VerificationError) else str(exc)
        print(f"xlaserve export: {one_line(found)}; the bundle is left at {args.out} for inspection",
              file=sys.stderr)
        return 1
    except TracingError as exc:
        at = where(exc.cause)
        print(f"xlaserve export: {one_line(str(exc))}" + (f" (raised at {at})" if at else ""), file=sys.stderr)
        log.debug("the traceback of that error", exc_info=exc.cause)
        return 2
    except (ExportError, ValueError) as exc:
        print(f"xlaserve export: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:            # anything else the user's code or a library raised
        print(f"xlaserve export: the export of {args.torch or args.function} failed: {describe(exc)}",
              file=sys.stderr)
        log.debug("the traceback of that error", exc_info=exc)
        return 2
    if result.verification:
        checks = result.verification.checks
        modules = len({c.module for c in checks})
        outputs_each = len(checks) // modules
        verified = (f"verified: {outputs_each} output{'s' if outputs_each != 1 else ''} of each module"
                    f" within tolerance of {args.torch or args.function}")
    else:
        verified = "not verified (--no-verify)"
    modules = (f"1 dynamic-batch module for sizes {','.join(map(str, sorted(sizes)))}" if args.dynamic_batch
               else f"{len(sizes)} modules")
    route = f", lowered by route {result.route}" if args.torch is not None else ""
    print(f"wrote {result.bundle}: {modules}, {len(result.weights_order)} weights{route}, {verified}")
    return 0


def _flax_source(args: argparse.Namespace, target: Any, params: Any) -> tuple[Any, Any]:
    """``(fn, params)`` for export_jax: a Flax model (the object MODULE:FUNCTION names, or with
    ``--flax`` what it returns) as :func:`xlaserve.export.from_flax.flax_function` runs it, with
    ``--params`` as a Linen model's variables; anything else as it is."""
    from xlaserve.export.from_flax import flax_function, flax_kind

    if args.flax:
        try:
            target = target()
        except Exception as exc:
            raise UsageError(f"--flax: {args.function}() raised {describe(exc)}") from None
        if flax_kind(target) is None:
            raise UsageError(f"--flax: {args.function}() returned {type(target).__name__}, not a Flax model"
                             " (an instance of flax.nnx.Module or flax.linen.Module)")
    if flax_kind(target) is None:
        return target, params
    from xlaserve.export.spec import ExportError
    try:
        return flax_function(target, params)
    except ExportError as exc:
        raise UsageError(f"{args.function}: {exc}") from None


def _torch_source(target: str) -> tuple[Any, Any]:
    """``--torch MODULE:FACTORY`` as (:func:`xlaserve.export.from_torch.export_torch`, the module).
    torch is imported here, only for ``--torch``; a missing install is a :class:`UsageError`."""
    try:
        from xlaserve.export.from_torch import export_torch, module_from
    except ImportError as exc:
        raise UsageError(f"--torch needs PyTorch and torch-mlir ({exc}); install them with"
                         " pip install 'xlaserve[export-torch]'") from None
    from xlaserve.export.spec import ExportError

    _, found = resolve(target, "--torch")
    try:
        return export_torch, module_from(found, f"--torch {target}")
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    except Exception as exc:            # the factory itself raised (a wrong keyword, say)
        raise UsageError(f"--torch {target}: calling it raised {describe(exc)}") from None
