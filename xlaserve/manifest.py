"""The bundle manifest: parsing and validation, no I/O.

Axes are named one letter each, listed fastest-varying first (column-major), as in the design we
started from; ``n`` is the batch axis. Row-major arrays (NumPy, StableHLO types, the KServe wire)
list the same axes in reverse, so :meth:`TensorDecl.row_major_shape` reverses the letters.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from xlaserve.bounded import shown
from xlaserve.dtypes import BY_CODE, EXECUTABLE_CODES, DType
from xlaserve.errors import BundleError

FORMAT_VERSION = "2.0"
BATCH_AXIS = "n"
#: The weights file a bundle uses when its manifest has no ``weights:`` key (if the file exists),
#: and the file ``weights: {}`` names when it gives no ``file``.
DEFAULT_WEIGHTS_FILE = "weights.safetensors"
_TOP_KEYS = {"format_version", "name", "kind", "executable_inputs", "executable_outputs",
             "client_inputs", "client_outputs", "weights", "batching"}
_TENSOR_KEYS = {"name", "dtype", "shape", "dims"}


@dataclass(frozen=True, slots=True)
class TensorDecl:
    """One tensor of a manifest. ``shape`` is column-major letters; ``dims`` sizes all but ``n``."""

    name: str
    dtype: DType
    shape: str
    dims: Mapping[str, int]
    # derived once (every request asks): the batch axis's row-major index, and the wire dims
    _batch_axis: int | None = field(init=False, repr=False, compare=False, default=None)
    _wire_dims: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        axis = len(self.shape) - 1 - self.shape.index(BATCH_AXIS) if BATCH_AXIS in self.shape else None
        object.__setattr__(self, "_batch_axis", axis)
        object.__setattr__(self, "_wire_dims", self.row_major_shape(-1))

    @property
    def batched(self) -> bool:
        return self._batch_axis is not None

    @property
    def batch_axis(self) -> int | None:
        """The batch axis's index in the row-major shape, or None when the tensor has none."""
        return self._batch_axis

    def row_major_shape(self, batch: int) -> tuple[int, ...]:
        return tuple(batch if a == BATCH_AXIS else self.dims[a] for a in reversed(self.shape))

    def wire_dims(self) -> tuple[int, ...]:
        """Row-major dims as KServe metadata reports them: -1 for the batch axis."""
        return self._wire_dims

    def describe(self, batch: int | str = "B") -> str:
        dims = ",".join(str(batch) if a == BATCH_AXIS else str(self.dims[a]) for a in reversed(self.shape))
        return f"{self.dtype.kserve}[{dims}]"


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated manifest. ``weights_file`` is the file the ``weights:`` key names, or None when
    the manifest has no ``weights:`` key; the bundle loader then uses :data:`DEFAULT_WEIGHTS_FILE`
    if it exists beside the manifest (names sorted), and no weights otherwise. The manifest parser
    does no I/O, so that choice is the loader's (:func:`xlaserve.bundle.read_weights`)."""

    bundle: str
    kind: str                                   # "model" | "meta"
    executable_inputs: tuple[TensorDecl, ...]
    executable_outputs: tuple[TensorDecl, ...]
    client_inputs: tuple[TensorDecl, ...]
    client_outputs: tuple[TensorDecl, ...]
    weights_file: str | None                    # None: no weights: key
    weights_order: tuple[str, ...] | None       # None: tensor names sorted
    compiled_batch_sizes: tuple[int, ...]       # ascending
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_batch_size(self) -> int:
        return self.compiled_batch_sizes[-1] if self.compiled_batch_sizes else 0


def _known_keys(block: Mapping, known: set[str] | frozenset[str], prefix: str, fail) -> None:
    """Raise ``fail(...)`` naming the keys of ``block`` that are not in ``known``, and the known ones."""
    unknown = set(block) - known
    if unknown:
        raise fail(f"{prefix}unknown key(s) {', '.join(sorted(map(str, unknown)))} (known: {', '.join(sorted(known))})")


def parse_manifest(data: Any, bundle: str) -> Manifest:
    """Validate a manifest's parsed YAML. Raises :class:`BundleError` naming the key at fault."""
    def fail(msg: str) -> BundleError:
        return BundleError(bundle, f"manifest.yaml: {msg}")

    if not isinstance(data, dict):
        raise fail(f"expected a mapping at the top level, got {type(data).__name__}")
    _known_keys(data, _TOP_KEYS, "", fail)
    version = data.get("format_version")
    if str(version) != FORMAT_VERSION:
        raise fail(f"format_version: expected \"{FORMAT_VERSION}\", got {shown(version)}")
    name = data.get("name")
    if name is not None and name != bundle:
        raise fail(f"name: '{name}' must equal the bundle's directory name '{bundle}'")
    kind = data.get("kind", "model")
    if kind not in ("model", "meta"):
        raise fail(f"kind: expected 'model' or 'meta', got {shown(kind)}")

    if kind == "meta":
        for key in ("executable_inputs", "executable_outputs", "weights", "batching"):
            if key in data:
                raise fail(f"{key}: a kind: meta bundle has no modules, so it takes no {key}")
        for key in ("client_inputs", "client_outputs"):
            if key not in data:
                raise fail(f"{key}: required for kind: meta")
        exe_in: tuple[TensorDecl, ...] = ()
        exe_out: tuple[TensorDecl, ...] = ()
        sizes: tuple[int, ...] = ()
    else:
        for key in ("executable_inputs", "executable_outputs", "batching"):
            if key not in data:
                raise fail(f"{key}: required")
        exe_in = _tensors(data["executable_inputs"], "executable_inputs", fail, executable=True)
        exe_out = _tensors(data["executable_outputs"], "executable_outputs", fail, executable=True)
        sizes = _batching(data["batching"], fail)

    cli_in = _tensors(data["client_inputs"], "client_inputs", fail, executable=False) if "client_inputs" in data else exe_in
    cli_out = _tensors(data["client_outputs"], "client_outputs", fail, executable=False) if "client_outputs" in data else exe_out

    weights_file, weights_order = None, None
    if "weights" in data:
        w = data["weights"]
        if not isinstance(w, dict):
            raise fail(f"weights: expected a mapping {{file, order}}, got {type(w).__name__}")
        _known_keys(w, {"file", "order"}, "weights: ", fail)
        weights_file = w.get("file", DEFAULT_WEIGHTS_FILE)
        if not isinstance(weights_file, str) or "/" in weights_file or weights_file.startswith("."):
            raise fail(f"weights.file: expected a file name inside the bundle, got {shown(weights_file)}")
        if "order" in w:
            order = w["order"]
            if not isinstance(order, list) or not all(isinstance(o, str) for o in order):
                raise fail(f"weights.order: expected a list of tensor names, got {shown(order)}")
            if len(set(order)) != len(order):
                raise fail("weights.order: names repeat")
            weights_order = tuple(order)

    return Manifest(bundle, kind, exe_in, exe_out, cli_in, cli_out, weights_file, weights_order,
                    sizes, MappingProxyType(dict(data)))


def _batching(batching: Any, fail) -> tuple[int, ...]:
    if not isinstance(batching, dict):
        raise fail(f"batching: expected a mapping with compiled_batch_sizes, got {type(batching).__name__}")
    _known_keys(batching, {"compiled_batch_sizes"}, "batching: ", fail)
    sizes = batching.get("compiled_batch_sizes")
    if (not isinstance(sizes, list) or not sizes
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)):
        raise fail(f"batching.compiled_batch_sizes: expected a non-empty list of positive integers, got {shown(sizes)}")
    if len(set(sizes)) != len(sizes):
        raise fail(f"batching.compiled_batch_sizes: sizes repeat in {sizes}")
    return tuple(sorted(sizes))


def _tensors(items: Any, key: str, fail, *, executable: bool) -> tuple[TensorDecl, ...]:
    if not isinstance(items, list) or not items:
        raise fail(f"{key}: expected a non-empty list of {{name, dtype, shape, dims}}")
    out: list[TensorDecl] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise fail(f"{where}: expected a mapping {{name, dtype, shape, dims}}, got {shown(item)}")
        _known_keys(item, _TENSOR_KEYS, f"{where}: ", fail)
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{where}.name: expected a non-empty string, got {shown(name)}")
        where = f"{key}[{i}] ('{name}')"
        if any(t.name == name for t in out):
            raise fail(f"{where}: the name repeats")
        code = item.get("dtype")
        allowed = EXECUTABLE_CODES if executable else tuple(BY_CODE)
        if code not in allowed:
            raise fail(f"{where}.dtype: expected one of {' '.join(allowed)}, got {shown(code)}")
        shape = item.get("shape")
        if not isinstance(shape, str) or not shape.isascii() or not shape.isalpha() or not shape.islower():
            raise fail(f"{where}.shape: expected lowercase axis letters such as \"whn\", got {shown(shape)}")
        if len(set(shape)) != len(shape):
            raise fail(f"{where}.shape: axis letters repeat in \"{shape}\"")
        dims = item.get("dims", {}) or {}
        if not isinstance(dims, dict):
            raise fail(f"{where}.dims: expected a mapping from axis letter to size, got {shown(dims)}")
        if BATCH_AXIS in dims:
            raise fail(f"{where}.dims: '{BATCH_AXIS}' is the batch axis and takes no size")
        need = set(shape) - {BATCH_AXIS}
        missing = need - set(dims)
        if missing:
            raise fail(f"{where}.dims: no size for axis {', '.join(sorted(missing))} of shape \"{shape}\"")
        extra = set(dims) - need
        if extra:
            raise fail(f"{where}.dims: axis {', '.join(sorted(map(str, extra)))} is not in shape \"{shape}\"")
        for axis, size in dims.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise fail(f"{where}.dims.{axis}: expected a positive integer, got {shown(size)}")
        if executable and BATCH_AXIS not in shape:
            raise fail(f"{where}.shape: executable tensors need the batch axis '{BATCH_AXIS}', got \"{shape}\"")
        out.append(TensorDecl(name, BY_CODE[code], shape, MappingProxyType(dict(dims))))
    return tuple(out)
