"""Loading a bundle: manifest, weights and modules, validated against each ``@main``.

:func:`load_bundle` is blocking (file reads, MLIR parsing, XLA compilation); the lifecycle
actor runs it off the Trio thread. It returns an immutable :class:`ModelVersion` or raises
:class:`BundleError` with a message that names the bundle, the tensor, what was expected and
what was found.

Reading a bundle (:func:`read_manifest`, :func:`find_modules`, :func:`read_weights`,
:func:`validate_signature`) imports no JAX: only :func:`load_bundle`, which compiles on a
device, imports the runtime that does (:mod:`xlaserve.runtime.executables`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import stat
import struct
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import yaml

from xlaserve._hooks import Registration, collecting_registrations
from xlaserve.bounded import expansion_problem, shown
from xlaserve.controlchars import CONTROL_CHARACTERS
from xlaserve.dtypes import BY_MLIR, DType, from_numpy
from xlaserve.errors import BundleError, describe_exception
from xlaserve.manifest import DEFAULT_WEIGHTS_FILE, Manifest, TensorDecl, parse_manifest
from xlaserve.progress import Step
from xlaserve.runtime.pool import aligned_bytes, packed_offsets
from xlaserve.runtime.signature import ModuleError, Signature, TensorType

if TYPE_CHECKING:   # the types of load_bundle's device side, which imports jax when it runs
    from xlaserve.runtime.executables import ExecutableTable
    from xlaserve.runtime.pjrt import CompiledMemory, Device

MANIFEST = "manifest.yaml"
HOOKS_FILE = "model.py"
_MODULE_RE = re.compile(r"^model\.b(\d+)\.(mlir|mlirbc)$")
#: The one module of a dynamic-batch bundle: its batch axes are dynamic (``?``) and the loader
#: specializes it to every compiled batch size.
DYNAMIC_MODULES = ("model.mlir", "model.mlirbc")


@dataclass(frozen=True, slots=True)
class WeightTensor:
    """One tensor of a safetensors file: where its bytes are (absolute file offset)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_checked(file: Path):
    """``(file opened for reading in binary, its size)`` if it is a regular file (or a link to
    one); else ``(None, what it is)``, nothing left open. Never blocks: a FIFO would hold the
    open until some writer came, and a link to ``/dev/zero`` or ``/dev/urandom`` would be read
    until memory ran out, either holding the lifecycle actor (or a weight-cache thread), and the
    worker's shutdown, for good. OSError when it cannot be opened."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return None, next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
        return open(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _open_regular(file: Path, bundle: str):
    """``(file opened for reading in binary, its size)`` (:func:`open_checked`); BundleError
    naming what it is when it is not a regular file."""
    opened, size_or_kind = open_checked(file)
    if opened is None:
        raise BundleError(bundle, f"{file.name} is {size_or_kind}; expected a regular file (or a link to one)")
    return opened, size_or_kind


def _read_regular(file: Path, bundle: str) -> bytes:
    """The bytes of a regular file of a bundle (see :func:`_open_regular`)."""
    f, _ = _open_regular(file, bundle)
    with f:
        return f.read()


def _read_at(fd: int, into: memoryview, offset: int) -> int:
    """Read ``len(into)`` bytes of ``fd`` from ``offset`` (one ``preadv`` a tensor, more only
    when the kernel returns less: it caps one read near 2 GiB); the bytes read, short at EOF."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if not got:
            break
        done += got
    return done


@dataclass(frozen=True, slots=True)
class HostWeights:
    """Where a model's weights live in its safetensors file, in binding order.

    Holds no arrays itself, so a version whose residency floor is ``unpinned`` keeps no host
    copy: the weight cache calls :meth:`read` once at admission for the host copy it keeps
    (floors ``system``/``device``), or on every load (``unpinned``).

    The host copy is private memory, never a mapping of the file: operators update weights with
    ``cp`` (which truncates and rewrites in place), and a shared mapping of a truncated file
    faults (SIGBUS) and would take the worker down with the version still serving from it.
    """

    file: Path
    tensors: tuple[WeightTensor, ...]
    declared: bool = True                       # False: found beside a manifest with no weights: key
    # Per tensor, the axis order it is handed to the modules in (numpy.transpose's axes), or
    # None for the file's own order: see :func:`_permute_kernels`.
    permutations: tuple[tuple[int, ...] | None, ...] = ()

    @property
    def origin(self) -> str:
        """Where the weights came from and why in this order, for error messages."""
        if self.declared:
            return f"{self.file.name} (the manifest's weights: key)"
        return (f"{self.file.name} (beside {MANIFEST}, which has no weights: key, so all its tensors, "
                "names sorted)")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """A fresh private copy of the weights (see :meth:`read`)."""
        return self.read()

    def read(self) -> tuple[np.ndarray, ...]:
        """A fresh private copy from disk: each tensor read into one page-aligned buffer, in
        binding order, each at the next 64-byte-aligned offset (the weight pool's layout,
        :func:`~xlaserve.runtime.pool.packed_offsets`, so that a load copies the whole buffer
        with one ``memcpy``); the arrays are views of it. Immune to later changes of the file."""
        if not self.tensors:
            return ()
        offsets = packed_offsets([t.nbytes for t in self.tensors])
        size = offsets[-1] + self.tensors[-1].nbytes
        buffer = aligned_bytes(size, 4096)
        # checked as at load: a file replaced by a FIFO since would hold this read, and the weight
        # cache's thread, until some writer came
        f, file_size = open_checked(self.file)
        if f is None:
            raise OSError(f"{self.file} is no longer a regular file; it changed on disk after the model was loaded")
        with f:
            self._check_size(file_size)
            fd, view = f.fileno(), memoryview(buffer)
            for t, at in zip(self.tensors, offsets):
                got = _read_at(fd, view[at:at + t.nbytes], t.offset)
                if got != t.nbytes:
                    raise OSError(f"{self.file}: read {got} of {t.nbytes} bytes of weight {t.name!r} (was the file "
                                  "truncated?)")
        permutations = self.permutations or (None,) * len(self.tensors)
        return tuple(self._view(view, t, at, p) for t, at, p in zip(self.tensors, offsets, permutations))

    def _check_size(self, size: int) -> None:
        end = max(t.offset + t.nbytes for t in self.tensors)
        if size < end:
            raise OSError(f"{self.file} is {size} bytes but its tensors end at byte {end}; it changed "
                          "on disk after the model was loaded")

    @staticmethod
    def _view(buffer: memoryview, t: WeightTensor, offset: int, axes: tuple[int, ...] | None) -> np.ndarray:
        count = t.nbytes // t.dtype.itemsize
        array = np.frombuffer(buffer, t.dtype, count, offset).reshape(t.shape)
        if axes is not None:
            # transposed in place (through a transient copy), so the host copy stays one buffer
            permuted = np.transpose(array, axes).copy()
            array = array.reshape(permuted.shape)
            array[...] = permuted
        array.flags.writeable = False
        return array


@dataclass(frozen=True, slots=True)
class CompiledModule:
    """One compiled batch size. ``path`` is its module file: ``model.b{N}.mlir``, or for a
    dynamic-batch bundle the one ``model.mlir`` every size was specialized from (``dynamic``).
    ``shared``: the executable was already loaded for another version with the identical module
    (:class:`~xlaserve.runtime.executables.ExecutableTable`), so neither compiled nor looked up
    in the executable cache; ``key`` is its entry there."""

    batch_size: int
    path: Path
    executable: object = field(repr=False)
    memory: CompiledMemory
    cache_hit: bool = False
    dynamic: bool = False
    shared: bool = False
    key: str = ""

    @property
    def label(self) -> str:
        """How messages name it: ``model.b4.mlir``, or ``model.mlir@b4`` when specialized."""
        return f"{self.path.name}@b{self.batch_size}" if self.dynamic else self.path.name


@dataclass(frozen=True, slots=True, weakref_slot=True)   # the weight cache watches a replaced one die
class ModelVersion:
    """One immutable, ready-to-serve version of a bundle."""

    name: str
    version: int
    path: Path
    manifest: Manifest
    fingerprint: str
    weights: HostWeights | None
    weight_bytes: int
    modules: Mapping[int, CompiledModule]
    hooks: Registration | None
    loaded_at: float

    @property
    def compiled_batch_sizes(self) -> tuple[int, ...]:
        return self.manifest.compiled_batch_sizes

    @property
    def is_meta(self) -> bool:
        return self.manifest.kind == "meta"


#: the longest name a directory may have (the file systems' NAME_MAX): a longer one is no bundle,
#: and os.stat raises ENAMETOOLONG for it instead of answering that nothing is there
MAX_BUNDLE_NAME_BYTES = 255


def name_bytes(name: str) -> int:
    """The length of ``name`` as a file name, in bytes (UTF-8)."""
    return len(name.encode("utf-8", "surrogatepass"))


def bundle_name_ok(name: str) -> bool:
    """Whether ``name`` can name a bundle: one directory directly inside the repository, not a
    hidden one, never a path (``../x``, ``/abs/x``), at most ``MAX_BUNDLE_NAME_BYTES`` long, and
    without control characters (a directory may hold a newline or an ESC in its name; a model
    name goes into log lines, metrics labels and dashboards, where one would fake a line or
    rewrite the operator's terminal)."""
    return (bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")
            and CONTROL_CHARACTERS.search(name) is None and name_bytes(name) <= MAX_BUNDLE_NAME_BYTES)


def is_bundle(path: Path) -> bool:
    """Whether ``path`` is a bundle the worker can load. A directory it may not search (``chmod
    000``, another user's ``0700``) is none: the PermissionError of looking for its manifest
    failed every rescan of the repository while that directory was there."""
    try:
        return bundle_name_ok(path.name) and path.is_dir() and (path / MANIFEST).is_file()
    except OSError:
        return False


def bundle_fingerprint(path: Path) -> str:
    """A digest of every file of the bundle (names, sizes, mtimes): changes when any file does."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        st = f.stat()
        h.update(f"{f.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


#: libyaml's safe loader where PyYAML has it: a catalog of a thousand bundles parses a thousand
#: manifests, and the pure-Python loader took most of the time of loading a bundle whose
#: executable is shared (about 8 ms of 10).
_FAST_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_manifest(path: Path) -> Manifest:
    name = path.name
    try:
        raw = _read_regular(path / MANIFEST, name)
    except OSError as exc:
        raise BundleError(name, f"cannot read {MANIFEST}: {exc.strerror}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise BundleError(name, f"{MANIFEST} is not UTF-8 text: byte {raw[exc.start]:#04x} on line {line} "
                          f"({exc.reason}); expected a YAML document in UTF-8") from None
    try:
        data = yaml.load(text, Loader=_FAST_SAFE_LOADER)
    except yaml.YAMLError:
        # parsed again by the pure-Python loader, whose message (and its marks) is the one
        # documented and tested, whichever loader found the problem
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise BundleError(name, f"{MANIFEST} is not valid YAML: {exc}") from None
        except RecursionError:      # libyaml refused the depth; the pure-Python loader recursed
            raise BundleError(name, f"{MANIFEST} nests lists or mappings too deeply to be read") from None
    problem = expansion_problem(data)
    if problem is not None:
        raise BundleError(name, f"{MANIFEST} cannot be read: {problem}")
    return parse_manifest(data, name)


def find_modules(path: Path, manifest: Manifest) -> dict[int, Path]:
    """The module file of each compiled batch size, smallest first: every size needs exactly one,
    either its own ``model.b{N}.mlir`` or the bundle's one dynamic-batch ``model.mlir`` (never
    both forms)."""
    found: dict[int, Path] = {}
    dynamic: list[Path] = []
    for f in sorted(path.iterdir()):
        if f.name in DYNAMIC_MODULES:
            dynamic.append(f)
            continue
        m = _MODULE_RE.match(f.name)
        if not m:
            continue
        size = int(m.group(1))
        if size in found:
            raise BundleError(manifest.bundle, f"batch size {size} has two modules: {found[size].name} and {f.name}")
        found[size] = f
    if len(dynamic) > 1:
        raise BundleError(manifest.bundle, f"two dynamic-batch modules, {dynamic[0].name} and {dynamic[1].name}; "
                          "keep one")
    if dynamic and found:
        raise BundleError(manifest.bundle, f"{dynamic[0].name} (one module for every batch size) and "
                          f"{', '.join(f.name for f in found.values())} (one per size) are both present; keep one form")
    if dynamic:
        return {size: dynamic[0] for size in manifest.compiled_batch_sizes}
    sizes = set(manifest.compiled_batch_sizes)
    missing = sorted(sizes - set(found))
    if missing:
        raise BundleError(manifest.bundle, "no module for compiled batch size(s) "
                          f"{missing}: expected {', '.join(f'model.b{n}.mlir' for n in missing)} (or .mlirbc), "
                          "or one dynamic-batch model.mlir for every size")
    extra = sorted(set(found) - sizes)
    if extra:
        raise BundleError(manifest.bundle, f"module(s) {', '.join(found[n].name for n in extra)} for batch size(s) "
                          f"{extra} not listed in batching.compiled_batch_sizes {list(manifest.compiled_batch_sizes)}")
    return dict(sorted(found.items()))          # smallest size first, as progress counts them


_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
}


#: the largest safetensors JSON header read (the safetensors library's own limit)
MAX_SAFETENSORS_HEADER = 100_000_000


def _read_safetensors_header(file: Path, bundle: str) -> dict[str, WeightTensor]:
    """The tensor table of a safetensors file: an 8-byte little-endian header length, a JSON
    header, then the data; offsets in the header are relative to the data. Everything in the
    header is checked before it is used: each tensor a mapping with a known dtype, a shape of
    integers >= 0 and two integer offsets with 0 <= begin <= end, its bytes exactly what the
    shape needs, inside the file. ValueError names what is wrong; BundleError (of ``bundle``)
    when it is not a regular file."""
    f, size = _open_regular(file, bundle)
    with f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than the 8-byte safetensors header length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"header length {length} runs past the end of the {size}-byte file")
        if length > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"the header is {length} bytes, more than the {MAX_SAFETENSORS_HEADER} a safetensors "
                             "header may have")
        try:
            header = json.loads(f.read(length))
        except RecursionError:
            raise ValueError("the header nests JSON arrays or objects too deeply to be read") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is not a JSON object of tensors (it is {type(header).__name__})")
    data = 8 + length
    tensors: dict[str, WeightTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {shown(name)} is not described by a JSON object (got {shown(info)})")
        code = info.get("dtype")
        dtype = _SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise ValueError(f"tensor {shown(name)} has dtype {shown(code)}; supported: "
                             f"{', '.join(_SAFETENSORS_DTYPES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {shown(name)}: 'shape' must be a list of integers >= 0, got {shown(shape)}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {shown(name)}: 'data_offsets' must be two integers 0 <= begin <= end, got "
                             f"{shown(offsets)}")
        begin, end = offsets
        needs = math.prod(shape) * dtype.itemsize       # exact: no int64 wrap-around
        if end - begin != needs or data + end > size:
            raise ValueError(f"tensor {shown(name)} spans bytes {begin}..{end} of the data but its shape "
                             f"{shown(shape)} of {code} needs {needs} (file is {size} bytes)")
        tensors[name] = WeightTensor(name, dtype, tuple(shape), data + begin)
    return tensors


def read_weights(path: Path, manifest: Manifest) -> HostWeights | None:
    """Read the weights file's tensor table and fix the order the tensors bind to ``@main``.

    With a ``weights:`` key, its ``file`` must exist and its ``order`` (default: every tensor of the
    file, names sorted) picks the tensors. Without one, :data:`DEFAULT_WEIGHTS_FILE` beside the
    manifest is used when it exists, every tensor, names sorted: the order ``jax.jit`` flattens a
    dict of parameters, so a module lowered as ``jit(fn).lower(params, *inputs)`` takes them as
    they are. No key and no file: no weights. The bytes themselves are read later by the weight
    cache (:class:`HostWeights`)."""
    declared = manifest.weights_file is not None
    name = manifest.weights_file if declared else DEFAULT_WEIGHTS_FILE
    file = path / name
    if not os.path.lexists(file):       # anything else there is read, or refused as what it is
        if not declared:
            return None
        raise BundleError(manifest.bundle, f"weights file {name} is missing (the manifest's weights: key asks for it)")
    try:
        table = _read_safetensors_header(file, manifest.bundle)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BundleError(manifest.bundle, f"cannot read {name}: {exc}") from None
    order = manifest.weights_order if manifest.weights_order is not None else tuple(sorted(table))
    # looked up in the table, not a list of its names: a header of a million tensors made that
    # check quadratic, holding the load for hours
    missing = [n for n in order if n not in table]
    if missing:
        raise BundleError(manifest.bundle, f"weights.order names {_listing([repr(n) for n in missing])} but {name} "
                          f"holds {len(table)} tensor(s): {_listing([repr(n) for n in sorted(table)])}")
    return HostWeights(file.resolve(), tuple(table[n] for n in order), declared)


def _type_of_decl(decl: TensorDecl, batch: int | None) -> TensorType:
    """The tensor's type at ``batch``; ``None`` leaves the batch axis dynamic (``?``)."""
    return TensorType(decl.row_major_shape(batch), decl.dtype.mlir or "?")


def _argument_types(manifest: Manifest, weights: HostWeights | None, batch: int | None) -> list[TensorType]:
    """What ``@main`` takes at ``batch``: the weights, then the executable inputs."""
    types = [TensorType(t.shape, from_numpy(t.dtype).mlir or "?") for t in weights.tensors] if weights else []
    return types + [_type_of_decl(d, batch) for d in manifest.executable_inputs]


def _describe(t: TensorType) -> str:
    dtype = BY_MLIR.get(t.element)
    kserve = dtype.kserve if dtype else t.element
    return f"{t} ({kserve}[{','.join('?' if d is None else str(d) for d in t.shape)}])"


def _listing(items: list[str], limit: int = 8) -> str:
    """``items`` joined by commas, the first ``limit`` of them: a model with hundreds of weights
    must not turn one error into pages."""
    if not items:
        return "nothing"
    more = f", and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def validate_signature(manifest: Manifest, module: Path, batch: int | None, sig: Signature,
                       weights: HostWeights | None, shown_as: str | None = None) -> None:
    """Check one module's ``@main`` against the manifest and weights; raise on the first mismatch.
    ``batch`` None checks a dynamic-batch module: every batch axis ``?``, all else as at any size.
    Errors name the module as ``shown_as`` (default: its file name)."""
    def fail(msg: str) -> BundleError:
        return BundleError(manifest.bundle, f"{shown_as or module.name}: {msg}")

    expected_in: list[tuple[str, TensorType]] = []
    if weights is not None:
        for t in weights.tensors:
            dt: DType = from_numpy(t.dtype)
            expected_in.append((f"weight '{t.name}'", TensorType(t.shape, dt.mlir or "?")))
    expected_in += [(f"input '{d.name}'", _type_of_decl(d, batch)) for d in manifest.executable_inputs]
    expected_out = [(f"output '{d.name}'", _type_of_decl(d, batch)) for d in manifest.executable_outputs]

    if len(sig.inputs) != len(expected_in):
        source = (f"{len(weights.names)} weight(s) from {weights.origin}" if weights is not None
                  else f"0 weight(s): no weights: key and no {DEFAULT_WEIGHTS_FILE} beside {MANIFEST}")
        at = next((i for i, ((_, want), got) in enumerate(zip(expected_in, sig.inputs)) if want != got),
                  min(len(expected_in), len(sig.inputs)))
        want = f"{expected_in[at][0]} {expected_in[at][1]}" if at < len(expected_in) else "nothing more"
        got = str(sig.inputs[at]) if at < len(sig.inputs) else "nothing more"
        raise fail(f"@main takes {len(sig.inputs)} argument(s) but the manifest gives {len(expected_in)} "
                   f"({source}; then {len(manifest.executable_inputs)} executable input(s)); they first "
                   f"differ at argument {at}: the manifest gives {want}, @main takes {got}. Expected, in "
                   f"order: {_listing([f'{label} {t}' for label, t in expected_in])}; "
                   f"@main takes: {_listing([str(t) for t in sig.inputs])}")
    if len(sig.outputs) != len(expected_out):
        raise fail(f"@main returns {len(sig.outputs)} result(s) but the manifest lists "
                   f"{len(expected_out)} executable output(s) ({', '.join(label for label, _ in expected_out)})")
    for i, ((label, want), got) in enumerate(zip(expected_in, sig.inputs)):
        if want != got:
            raise fail(f"{label} (argument {i} of @main): expected {_describe(want)}, found {_describe(got)}")
    for i, ((label, want), got) in enumerate(zip(expected_out, sig.outputs)):
        if want != got:
            raise fail(f"{label} (result {i} of @main): expected {_describe(want)}, found {_describe(got)}")


_hook_loads = itertools.count(1)


def import_hooks(path: Path, manifest: Manifest, version: int) -> Registration | None:
    """Import the bundle's model.py in isolation and return what it registered for this bundle."""
    file = path / HOOKS_FILE
    if not os.path.lexists(file):       # a FIFO or a directory there is refused, never skipped
        if manifest.kind == "meta":
            raise BundleError(manifest.bundle, f"kind: meta needs a {HOOKS_FILE} that calls register_model(..., run=...)")
        return None
    # A fresh, unique module name per load: bundles never clash and a reload re-imports. The
    # module is a package over the bundle directory, so `from . import helpers` finds the
    # bundle's own helpers.py under the same unique prefix. The source is compiled here rather
    # than by the import system so that no __pycache__ is written into the model repository.
    module_name = (f"_xlaserve_bundle_{re.sub(r'[^0-9A-Za-z_]', '_', manifest.bundle)}_v{version}"
                   f"_{next(_hook_loads)}")
    spec = importlib.util.spec_from_file_location(module_name, file, submodule_search_locations=[str(path)])
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    try:
        code = compile(_read_regular(file, manifest.bundle), str(file), "exec", dont_inherit=True)
    except OSError as exc:
        raise BundleError(manifest.bundle, f"cannot read {HOOKS_FILE}: {exc.strerror}") from None
    except SyntaxError as exc:
        line = f" line {exc.lineno}" if exc.lineno else ""   # none for a NUL byte
        raise BundleError(manifest.bundle, f"{HOOKS_FILE}{line}: {exc.msg}") from None
    except (MemoryError, RecursionError) as exc:    # past the compiler's own limits, e.g. `- - - ... 1`
        raise BundleError(manifest.bundle, f"{HOOKS_FILE} cannot be compiled ({type(exc).__name__}): it nests "
                          "expressions too deeply or is too large; expected Python source within the "
                          "compiler's limits") from None
    sys.modules[module_name] = module
    with collecting_registrations() as table:
        try:
            exec(code, module.__dict__)
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt or any BaseException: user code fails this load only;
            # let through, it ended the lifecycle actor and with it the worker
            raise BundleError(manifest.bundle, f"{HOOKS_FILE} raised {type(exc).__name__}: "
                              f"{describe_exception(exc)}") from None
        finally:
            for loaded in [m for m in sys.modules if m == module_name or m.startswith(module_name + ".")]:
                del sys.modules[loaded]
    others = sorted(set(table) - {manifest.bundle})
    if others:
        raise BundleError(manifest.bundle, f"{HOOKS_FILE} registers {others}; a bundle registers only its own "
                          f"name '{manifest.bundle}'")
    reg = table.get(manifest.bundle)
    if manifest.kind == "meta" and (reg is None or reg.run is None):
        raise BundleError(manifest.bundle, f"kind: meta needs register_model('{manifest.bundle}', run=...) in {HOOKS_FILE}")
    if manifest.kind == "model" and reg is not None and reg.run is not None:
        raise BundleError(manifest.bundle, "run= is only for kind: meta bundles; use preprocess/postprocess")
    return reg


@dataclass(frozen=True, slots=True)
class BundleHead:
    """What a load reads before it compiles anything: the manifest, and what ``model.py``
    registered. Reading it runs the bundle author's code (the import of ``model.py``), which may
    never return; the lifecycle bounds this stage alone (``model_import_timeout_seconds``), not
    the compilation after it, which holds nothing a later load needs if it is abandoned."""

    manifest: Manifest
    hooks: Registration | None


def read_head(path: Path, version: int, hooks: bool = True) -> BundleHead:
    """The manifest, then ``model.py`` imported (:func:`import_hooks`; not with ``hooks=False``);
    BundleError naming what is wrong. Acquires nothing: a caller that gives up on it has nothing
    to give back."""
    if not (path / MANIFEST).is_file():
        raise BundleError(path.name, f"{MANIFEST} is missing (a bundle directory needs one)")
    manifest = read_manifest(path)
    return BundleHead(manifest, import_hooks(path, manifest, version) if hooks else None)


Compile = Callable[[Path, bytes], tuple[object, bool]]


def _permute_kernels(weights: HostWeights, texts: dict[int, bytes],
                     table: ExecutableTable) -> tuple[HostWeights, dict[int, bytes]]:
    """The weights and modules with every convolution-kernel weight handed over in the order
    the device's convolutions take kernels in (:func:`~xlaserve.runtime.pjrt.kernel_permutations`):
    the weight is transposed once, when it is read from disk, instead of inside every call. A
    weight is permuted only when every module of the bundle asks for the same order, so one
    device copy serves them all. The modules are rewritten to take it so
    (:func:`~xlaserve.runtime.pjrt.relayout`), so an executable cache keys on the rewritten bytes."""
    count = len(weights.tensors)
    agreed: dict[int, tuple[int, ...]] | None = None
    for text in texts.values():
        found = {i: p for i, p in table.kernel_permutations(text).items() if i < count}
        agreed = found if agreed is None else {i: p for i, p in agreed.items() if found.get(i) == p}
    if not agreed:
        return weights, texts
    permutations = tuple(agreed.get(i) for i in range(count))
    return (dataclasses.replace(weights, permutations=permutations),
            {size: table.relayout(text, agreed) for size, text in texts.items()})


def load_bundle(path: Path, version: int, device: Device, compile_module: Compile | None = None,
                progress: Callable[[str], None] | None = None, fingerprint: str | None = None,
                executables: ExecutableTable | None = None, head: BundleHead | None = None) -> ModelVersion:
    """Read, validate and compile one bundle.

    ``executables``: the worker's :class:`~xlaserve.runtime.executables.ExecutableTable`, which
    holds one executable per distinct module and hands it to every version built from that
    module (variants of one architecture share it); it also remembers each distinct module's
    signature and specializations, so an identical module is parsed once. Each module's
    ``@main`` is still validated against this bundle's manifest and weights, so errors name this
    bundle. The version holds one reference per module and gives them back when it is collected.
    Without a table, a private one is used (nothing is shared), compiling with
    ``compile_module(path, module_bytes) -> (executable, cache_hit)`` (default: ``device``
    directly); with one, the table's own compile function is used and ``compile_module`` must
    be None.

    A dynamic-batch bundle's ``model.mlir`` is specialized to each compiled batch size first
    (:func:`xlaserve.runtime.pjrt.specialize`), and the executable is keyed on the specialized
    module. ``progress`` hears one :class:`~xlaserve.progress.Step` per module XLA compiled (the
    slow part; executable-cache hits and shared executables are left to the caller's summary).
    ``fingerprint``: the bundle's :func:`bundle_fingerprint` when the caller has just taken it
    (else taken here). ``head``: the bundle's :func:`read_head` when the caller has read it
    (the lifecycle does, in its own time-bounded step; else read here)."""
    if executables is None:
        from xlaserve.runtime.executables import ExecutableTable
        executables = ExecutableTable(device, compile_module)
    elif compile_module is not None:
        raise TypeError("load_bundle: pass compile_module or executables, not both (the table compiles)")
    fingerprint = fingerprint or bundle_fingerprint(path)
    if head is None:
        manifest = read_manifest(path)
        hooks = import_hooks(path, manifest, version)
    else:
        manifest, hooks = head.manifest, head.hooks
    if manifest.kind == "meta":
        return ModelVersion(manifest.bundle, version, path, manifest, fingerprint, None, 0,
                            MappingProxyType({}), hooks, time.time())
    module_files = find_modules(path, manifest)
    weights = read_weights(path, manifest)
    texts: dict[int, bytes] = {}
    dynamic = any(f.name in DYNAMIC_MODULES for f in module_files.values())
    source = b""
    if dynamic:
        # One module for every size: its @main must match the manifest with every batch axis
        # dynamic, then each specialization is validated like a module of that size.
        file = next(iter(module_files.values()))
        try:
            source = _read_regular(file, manifest.bundle)
            sig = executables.signature(source)
        except OSError as exc:
            raise BundleError(manifest.bundle, f"cannot read {file.name}: {exc.strerror}") from None
        except ModuleError as exc:
            raise BundleError(manifest.bundle, f"{file.name}: {exc}") from None
        validate_signature(manifest, file, None, sig, weights, f"{file.name} (the dynamic-batch module)")
    for size, file in module_files.items():
        try:
            texts[size] = (executables.specialize(source, _argument_types(manifest, weights, size)) if dynamic
                           else _read_regular(file, manifest.bundle))
            sig = executables.signature(texts[size])
        except OSError as exc:
            raise BundleError(manifest.bundle, f"cannot read {file.name}: {exc.strerror}") from None
        except ModuleError as exc:
            where = f"{file.name} cannot be specialized to batch size {size}" if dynamic else file.name
            raise BundleError(manifest.bundle, f"{where}: {exc}") from None
        validate_signature(manifest, file, size, sig, weights, f"{file.name}@b{size}" if dynamic else None)
    if device.rewrites_depthwise:
        # before the kernels are permuted: a written-out depthwise kernel is no convolution's
        texts = {size: executables.rewrite_convolutions(text) for size, text in texts.items()}
    if weights is not None and device.permutes_kernels:
        weights, texts = _permute_kernels(weights, texts, executables)
    modules: dict[int, CompiledModule] = {}
    try:
        for index, (size, file) in enumerate(module_files.items(), 1):
            label = f"{file.name}@b{size}" if dynamic else file.name
            started = time.perf_counter()
            try:
                got = executables.acquire(file, texts[size])
            except BundleError:
                raise
            except Exception as exc:
                raise BundleError(manifest.bundle, f"{label}: XLA could not compile it: {_oneline(exc)}") from None
            entry = got.entry
            modules[size] = CompiledModule(size, file, entry.executable, entry.memory, got.how == "cache", dynamic,
                                           got.how == "shared", entry.key)
            if progress and got.how == "compiled":
                progress(Step("compile", index, len(module_files),
                              f"{manifest.bundle}: {label} compiled in {time.perf_counter() - started:.2f}s"
                              f" ({index}/{len(module_files)})"))
        model = ModelVersion(manifest.bundle, version, path, manifest, fingerprint, weights,
                             weights.nbytes if weights else 0, MappingProxyType(modules), hooks, time.time())
    except BaseException:
        executables.release(*(m.key for m in modules.values()))
        raise
    # The version's references are given back when it is collected (unloaded, or replaced and
    # its last request answered), wherever that happens; not at exit, when nothing needs them.
    weakref.finalize(model, executables.release, *(m.key for m in modules.values())).atexit = False
    return model


def _oneline(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__
