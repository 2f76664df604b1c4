"""Triton's system shared-memory extension: clients on the same host register POSIX shared-memory
objects by name and pass tensors through them instead of through the gRPC message.

The registry is frontend state, used on the worker's Trio thread only (no locks). A region is an
``mmap`` of ``[offset, offset + byte_size)`` of ``/dev/shm/<key>``. Inputs are handed to the codec
as ``memoryview`` slices of that map, so ``np.frombuffer`` reads the client's bytes in place; outputs
are written from the result array with ``pwrite`` on the object's descriptor (one copy, as into the
map, but a full ``/dev/shm`` is then an error answer, not a SIGBUS).

Unregistering a region that requests are still reading is safe: the region leaves the table at
once (new requests get NOT_FOUND), but the mapping itself is released only when the last view of
it is gone. Every array decoded from a region holds a buffer export on the map, and ``mmap``
refuses to close while exports exist; so :meth:`SharedMemoryRegistry.unregister` closes what it can
now and leaves a busy map to be unmapped by its last user (CPython unmaps an ``mmap`` when it is
freed). Nothing ever reads unmapped memory.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from xlaserve.codec import int_parameter, serialize_bytes
from xlaserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from xlaserve.manifest import TensorDecl

SHM_DIR = "/dev/shm"
ENABLE_HINT = ("client shared memory is disabled on this server; set endpoints.allow_client_shm: true in the "
               "node file (or its environment override) to enable it, and only for clients on the same host "
               "that you trust")
CUDA_UNAVAILABLE = ("CUDA shared memory is not available: xlaserve takes system shared memory "
                    "(SystemSharedMemoryRegister) on every backend; CUDA IPC regions are not supported")

#: regions registered at once: each is a mapping of the process, and a process has at most
#: vm.max_map_count (65,530 by default) of them for everything it maps (its own allocations too)
MAX_REGIONS = 1024
#: the longest region name (Triton's clients name regions with a few words)
MAX_REGION_NAME = 256

# A POSIX shared-memory name: optional leading slashes (shm_open's convention, which tritonclient
# keeps), then one path component of ordinary characters.
_KEY = re.compile(r"/*([A-Za-z0-9_.\-:@+]{1,255})")


@dataclass(frozen=True, slots=True)
class RegionStatus:
    """A snapshot of one registered region, as SystemSharedMemoryStatus reports it."""

    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """One mapped region. Owned by the registry; ``view`` covers exactly the registered bytes
    (inputs are read through it); ``fd`` is the object's descriptor (outputs are written through
    it: see :meth:`SharedMemoryRegistry.write_output`)."""

    __slots__ = ("_map", "fd", "status", "view")

    def __init__(self, status: RegionStatus, mapping: mmap.mmap, start: int, fd: int) -> None:
        self.status = status
        self._map = mapping
        self.fd = fd
        self.view = memoryview(mapping)[start:start + status.byte_size]

    def object_size(self) -> int:
        """The shared-memory object's size now (the client may have shrunk it since registering)."""
        return os.fstat(self.fd).st_size

    def release(self) -> None:
        """Drop this region's own hold on the map, and its descriptor (only the Trio thread
        writes through it, and the region has left the table). If in-flight requests still hold
        views, the map is freed with the last of them."""
        os.close(self.fd)
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass


def _object_name(key: str) -> str:
    """The /dev/shm entry a key names, or InvalidArgument when the key is not a plain name."""
    match = _KEY.fullmatch(key)
    if match is None or match.group(1) in (".", ".."):
        raise InvalidArgument(f"shared-memory key '{key}' is not a POSIX shared-memory object name: expected "
                              "one name of letters, digits and '_.-:@+' with an optional leading '/' (as "
                              "shm_open takes it), never a path ('/' inside, '..')")
    return match.group(1)


class SharedMemoryRegistry:
    """Registered system shared-memory regions by name. Not thread-safe: used on the Trio thread only."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self._dir = shm_dir
        self._regions: dict[str, _Region] = {}

    # ---- the three RPCs -------------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> RegionStatus:
        if not name:
            raise InvalidArgument("a shared-memory region needs a non-empty name")
        if len(name) > MAX_REGION_NAME:
            raise InvalidArgument(f"shared-memory region name '{name[:40]}...' is {len(name)} characters long; "
                                  f"at most {MAX_REGION_NAME}")
        if name in self._regions:
            have = self._regions[name].status
            raise InvalidArgument(f"shared-memory region '{name}' is already registered (key '{have.key}', "
                                  f"offset {have.offset}, byte_size {have.byte_size}); unregister it first")
        if len(self._regions) >= MAX_REGIONS:
            raise ResourceExhausted(f"{MAX_REGIONS} shared-memory regions are registered, the most this server "
                                    f"keeps; unregister one before registering '{name}'")
        obj = _object_name(key)
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(f"shared-memory region '{name}': offset must be >= 0 and byte_size > 0, got "
                                  f"offset {offset}, byte_size {byte_size}")
        path = os.path.join(self._dir, obj)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidArgument(f"shared-memory region '{name}': no shared-memory object '{key}' exists "
                                  f"({path}); create it (shm_open) before registering") from None
        except OSError as exc:
            raise InvalidArgument(f"shared-memory region '{name}': cannot open shared-memory object '{key}': "
                                  f"{exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"shared-memory region '{name}': '{key}' is not a shared-memory object")
            if offset + byte_size > info.st_size:
                raise InvalidArgument(f"shared-memory region '{name}': offset {offset} + byte_size {byte_size} = "
                                      f"{offset + byte_size} runs past the end of shared-memory object '{key}' "
                                      f"({info.st_size} bytes)")
            start = offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
            except OSError as exc:     # the process's mappings or memory are exhausted
                raise ResourceExhausted(f"shared-memory region '{name}': cannot map '{key}': {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        status = RegionStatus(name, key, offset, byte_size)
        self._regions[name] = _Region(status, mapping, start, fd)
        return status

    def unregister(self, name: str = "") -> list[str]:
        """Forget one region (or all, for ``""``). Unknown names are not an error (as in Triton), so
        clean-up code may call this unconditionally. Returns the names removed."""
        names = [name] if name else list(self._regions)
        removed = []
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                region.release()
                removed.append(n)
        return removed

    def status(self, name: str = "") -> list[RegionStatus]:
        if name:
            region = self._regions.get(name)
            if region is None:
                raise NotFound(self._unknown(name))
            return [region.status]
        return [r.status for r in self._regions.values()]

    def close(self) -> None:
        self.unregister()

    # ---- the data path ------------------------------------------------------------------
    def read_input(self, tensor_name: str, parameters: Mapping) -> memoryview:
        """The bytes an input tensor names: a view into the region, no copy (``codec.ShmReader``)."""
        region, offset, size = self._locate(tensor_name, parameters)
        return region.view[offset:offset + size]

    def check_output(self, tensor_name: str, parameters: Mapping) -> None:
        """Validate a requested output's region before the model runs, so a bad region costs nothing."""
        self._locate(tensor_name, parameters)

    def write_output(self, decl: TensorDecl, array: np.ndarray, parameters: Mapping, tensor) -> None:
        """Copy one output into its region and describe it on the response tensor.

        Like Triton, the response tensor keeps its name, datatype and shape; the caller adds an empty
        ``raw_output_contents`` entry in its place. The tensor also carries the region parameters
        (the byte size is what was written), so a client can read exactly those bytes back.
        """
        region, offset, size = self._locate(decl.name, parameters)
        if decl.dtype.kserve == "BYTES":
            data = serialize_bytes(array)
            nbytes = len(data)
        else:
            array = np.asarray(array, dtype=decl.dtype.numpy)
            nbytes = array.nbytes
        if nbytes > size:
            raise InvalidArgument(f"output '{decl.name}': shared_memory_byte_size {size} is too small for the "
                                  f"result ({nbytes} bytes for {decl.dtype.kserve}{list(array.shape)})")
        # Written with pwrite, not through the map: a page of the object that was never written
        # (a sparse object, as ftruncate makes one) is allocated by the write, and with /dev/shm
        # full a store through the map would kill the worker with SIGBUS; pwrite says ENOSPC.
        if decl.dtype.kserve != "BYTES":
            data = memoryview(np.ascontiguousarray(array)).cast("B")
        position = region.status.offset + offset
        written = 0
        try:
            while written < nbytes:
                step = os.pwrite(region.fd, data[written:], position + written)
                if not step:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += step
        except OSError as exc:
            raise ResourceExhausted(f"output '{decl.name}': cannot write {nbytes} bytes into shared-memory region "
                                    f"'{region.status.name}' (object '{region.status.key}'): {exc.strerror}; "
                                    "the shared-memory file system may be full") from None
        tensor.parameters["shared_memory_region"].string_param = region.status.name
        tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
        if offset:
            tensor.parameters["shared_memory_offset"].int64_param = offset

    # ---- helpers ------------------------------------------------------------------------
    def _locate(self, tensor_name: str, parameters: Mapping) -> tuple[_Region, int, int]:
        param = parameters["shared_memory_region"]
        if param.WhichOneof("parameter_choice") != "string_param":
            raise InvalidArgument(f"tensor '{tensor_name}': parameter 'shared_memory_region' must be a string")
        name = param.string_param
        size = int_parameter(parameters, "shared_memory_byte_size", f"tensor '{tensor_name}'")
        if size is None:
            raise InvalidArgument(f"tensor '{tensor_name}' names shared-memory region '{name}' without "
                                  "'shared_memory_byte_size'; both are required")
        offset = int_parameter(parameters, "shared_memory_offset", f"tensor '{tensor_name}'") or 0
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"tensor '{tensor_name}': {self._unknown(name)}")
        if offset + size > region.status.byte_size:
            raise InvalidArgument(f"tensor '{tensor_name}': shared_memory_offset {offset} + shared_memory_byte_size "
                                  f"{size} = {offset + size} is outside region '{name}' "
                                  f"({region.status.byte_size} bytes registered)")
        end = region.status.offset + offset + size
        now = region.object_size()
        if end > now:
            # Touching pages past the end of a shrunk object faults (SIGBUS) and would take the
            # whole worker down: refuse the request instead.
            raise InvalidArgument(f"tensor '{tensor_name}': shared-memory object '{region.status.key}' of region "
                                  f"'{name}' is now {now} bytes, but the tensor ends at byte {end}; it shrank "
                                  "after it was registered (unregister and register it again)")
        return region, offset, size

    def _unknown(self, name: str) -> str:
        known = ", ".join(repr(n) for n in self._regions) or "none"
        return f"shared-memory region '{name}' is not registered (registered: {known})"


def disabled(rpc: str) -> FailedPrecondition:
    """What every system shared-memory RPC answers while ``endpoints.allow_client_shm`` is false."""
    return FailedPrecondition(f"{rpc}: {ENABLE_HINT}")


def cuda_unavailable(rpc: str) -> Unavailable:
    return Unavailable(f"{rpc}: {CUDA_UNAVAILABLE}")
