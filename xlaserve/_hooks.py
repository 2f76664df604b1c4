"""What a bundle's ``model.py`` imports: :class:`NamedTensor` and :func:`register_model`; and
:func:`conform`, how the server checks what hooks give back against the manifest.

The bundle loader imports ``model.py`` inside :func:`collecting_registrations`, so
``register_model`` calls land in that load's own table; nothing is global.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.dtypes import from_numpy
from xlaserve.errors import InternalError, describe_exception
from xlaserve.errors import cut_text as _cut
from xlaserve.manifest import TensorDecl


@dataclass(frozen=True, slots=True)
class NamedTensor:
    """A named NumPy array, row-major, batch included: what hooks take and return."""

    name: str
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    preprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None
    postprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None
    run: Callable[..., Any] | None = None


_collector: contextvars.ContextVar[dict[str, Registration] | None] = contextvars.ContextVar(
    "xlaserve_registrations", default=None)


def register_model(name: str, *, preprocess=None, postprocess=None, run=None) -> None:
    """Attach Python hooks to the bundle ``name``. Call it at the top level of ``model.py``.

    ``preprocess(tensors) -> tensors`` maps the client's inputs to the executable's;
    ``postprocess(tensors) -> tensors`` maps the executable's outputs to the client's;
    ``run(tensors, ctx) -> tensors`` is a meta model's whole body (``ctx.infer(model, tensors)``
    calls another model through the scheduler).
    """
    table = _collector.get()
    if table is None:
        raise RuntimeError("register_model() is only effective while xlaserve loads a bundle's model.py")
    for label, hook in (("preprocess", preprocess), ("postprocess", postprocess), ("run", run)):
        if hook is not None and not callable(hook):
            raise TypeError(f"register_model('{name}'): {label} must be callable, got {type(hook).__name__}")
    if name in table:
        raise ValueError(f"register_model('{name}') was called twice")
    table[name] = Registration(name, preprocess, postprocess, run)


@contextlib.contextmanager
def collecting_registrations() -> Iterator[dict[str, Registration]]:
    table: dict[str, Registration] = {}
    token = _collector.set(table)
    try:
        yield table
    finally:
        _collector.reset(token)


def conform(tensors: Any, decls: Sequence[TensorDecl], *, where: str, rows: int | None,
            any_rows: bool = False, max_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Check tensors a hook produced (or a meta model passes on) against manifest declarations.

    ``tensors`` is a list of :class:`NamedTensor` or a mapping of name to array. Every declared
    tensor must be present once and nothing else; each must be a NumPy array of the declared
    dtype (BYTES: object, ``bytes_`` or ``str_`` arrays) with the declared row-major shape.
    ``rows`` is the length every batch axis must have; None takes it from the first batched
    tensor (all must agree, at least 1, at most ``max_rows``); ``any_rows`` lets each batch axis
    have any length, zero included (a meta model's outputs). Returns the arrays in declaration
    order and the rows: plain ``numpy.ndarray`` (a subclass is copied into one), BYTES as object
    arrays of ``bytes`` (``str`` encoded as UTF-8) or ``S`` arrays, so that encoding the reply
    runs no user code and cannot fail.

    Raises :class:`InternalError` only, whatever ``tensors`` is (user code made it: a name that
    is a list, an object whose ``__eq__`` or ``__len__`` raises): its message starts with
    ``where`` and names the tensor, what the manifest declares and what was found.
    """
    try:
        return _conform(tensors, decls, where, rows, any_rows, max_rows)
    except InternalError:
        raise
    except Exception as exc:
        declared = ", ".join(f"'{d.name}' {d.describe()}" for d in decls)
        raise InternalError(f"{where}: could not be checked ({type(exc).__name__}: {describe_exception(exc)}); "
                            f"expected {EXPECTED_TENSORS} holding {declared}") from None


EXPECTED_TENSORS = "a list of NamedTensor(name: str, data: numpy.ndarray) or a dict of str to numpy.ndarray"


def _quote(value: Any) -> str:
    """What an error message quotes of a value user code made, at most (its repr, cut)."""
    try:
        text = repr(value)
    except BaseException:     # SystemExit too: user code
        return f"<{type(value).__name__} whose repr() raised>"
    return _cut(text)


def _conform(tensors: Any, decls: Sequence[TensorDecl], where: str, rows: int | None, any_rows: bool,
             max_rows: int | None) -> tuple[dict[str, np.ndarray], int]:
    declared = ", ".join(f"'{d.name}' {d.describe()}" for d in decls)
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (list, tuple)):
        bad = next((t for t in tensors if not isinstance(t, NamedTensor)), None)
        if bad is not None:
            raise InternalError(f"{where}: expected a list of NamedTensor, found an element of type "
                                f"{type(bad).__name__}")
        items = [(t.name, t.data) for t in tensors]
    else:
        raise InternalError(f"{where}: expected a list of NamedTensor, found {type(tensors).__name__}")
    given: dict[str, Any] = {}
    for name, data in items:
        if not isinstance(name, str):
            raise InternalError(f"{where}: a tensor's name must be a str, found {type(name).__name__} "
                                f"{_quote(name)}; the manifest declares {declared}")
        if name in given:
            raise InternalError(f"{where}: tensor '{name}' appears twice")
        given[name] = data
    by_name = {d.name: d for d in decls}
    unknown = [n for n in given if n not in by_name]
    if unknown:
        raise InternalError(f"{where}: unexpected tensor(s) {', '.join(_quote(n) for n in unknown)}; "
                            f"the manifest declares {declared}")
    missing = [d.name for d in decls if d.name not in given]
    if missing:
        raise InternalError(f"{where}: missing tensor(s) {', '.join(repr(n) for n in missing)}; "
                            f"the manifest declares {declared}")
    out: dict[str, np.ndarray] = {}
    rows_from = ""
    for decl in decls:
        data = given[decl.name]
        if not isinstance(data, np.ndarray):
            raise InternalError(f"{where}: tensor '{decl.name}': expected a NumPy array {decl.describe(rows or 'B')}, "
                                f"found {type(data).__name__}")
        if type(data) is not np.ndarray:
            # a subclass's methods and properties (shape, __array_function__) are user code: they
            # run here, in the hook's thread, never where the reply is encoded (the Trio thread)
            data = np.array(data, subok=False)
        if decl.dtype.kserve == "BYTES":
            data = _plain_bytes(decl, data, where)
        if not _dtype_ok(decl, data):
            raise InternalError(f"{where}: tensor '{decl.name}': expected dtype {decl.dtype.kserve} "
                                f"({decl.describe(rows or 'B')}), found {_found(data)}")
        axis = decl.batch_axis
        if axis is not None and not any_rows and data.ndim == len(decl.shape):
            n = int(data.shape[axis])
            if rows is None:
                if n < 1 or (max_rows is not None and n > max_rows):
                    limit = f" and at most {max_rows} (the largest compiled batch size)" if max_rows else ""
                    raise InternalError(f"{where}: tensor '{decl.name}': the batch axis (axis {axis}) must be at "
                                        f"least 1{limit}, found {_found(data)}")
                rows, rows_from = n, decl.name
            elif n != rows and rows_from:
                raise InternalError(f"{where}: tensor '{decl.name}' has {n} rows on its batch axis but "
                                    f"'{rows_from}' has {rows}; all tensors share the batch axis")
        expected = decl.row_major_shape(rows if rows is not None else -1)
        ok = data.ndim == len(expected) and all(
            g == w or (a == axis and (any_rows or rows is None)) for a, (w, g) in enumerate(zip(expected, data.shape)))
        if not ok:
            want = decl.describe("any" if any_rows else rows if rows is not None else "B")
            raise InternalError(f"{where}: tensor '{decl.name}': expected shape {want}, found {_found(data)}")
        out[decl.name] = data
    return out, rows if rows is not None else 1


def _dtype_ok(decl: TensorDecl, data: np.ndarray) -> bool:
    if decl.dtype.kserve == "BYTES":
        return data.dtype.kind == "S" or (data.dtype.kind == "O" and all(type(x) is bytes for x in data.reshape(-1)))
    return data.dtype == decl.dtype.numpy


def _plain_bytes(decl: TensorDecl, data: np.ndarray, where: str) -> np.ndarray:
    """A BYTES tensor's elements as plain ``bytes`` (``str`` encoded as UTF-8), in an object
    array of the same shape; ``S`` arrays and arrays with other elements as they are (the dtype
    check refuses the latter). Encoding the reply then runs no user code (a ``str`` subclass's
    ``__str__``) and cannot fail (a ``str`` holding a lone surrogate, which UTF-8 cannot encode)."""
    if data.dtype.kind not in "UO":
        return data
    flat = data.reshape(-1)
    out = np.empty(flat.shape, dtype=object)
    for i, item in enumerate(flat):
        if isinstance(item, bytes):
            out[i] = bytes.__getitem__(item, slice(None))   # the bytes themselves, whatever the subclass says
        elif isinstance(item, str):
            try:
                out[i] = str.encode(item, "utf-8")
            except UnicodeEncodeError as exc:
                raise InternalError(f"{where}: tensor '{decl.name}': element {i} is a str that UTF-8 cannot encode "
                                    f"({exc.reason} at position {exc.start}); expected bytes or a str of Unicode "
                                    "characters") from None
        else:
            return data
    return out.reshape(data.shape)


def _found(data: np.ndarray) -> str:
    try:
        name = from_numpy(data.dtype).kserve
    except KeyError:
        name = str(data.dtype)
    if data.dtype.kind == "O":
        name = "object"
    return f"{name}[{','.join(str(d) for d in data.shape)}]"
