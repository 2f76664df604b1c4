"""System shared memory with the unchanged Triton client: register, infer with inputs and outputs in
regions, read results back from the region; every bad region answered precisely; unregister while
a request still reads is safe; the feature is off unless endpoints.allow_client_shm says so."""
from __future__ import annotations

import itertools
import os
import uuid
from types import MappingProxyType

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import serve
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.errors import InvalidArgument, NotFound, ResourceExhausted
from xlaserve.frontend import shm as shm_module
from xlaserve.frontend.shm import SharedMemoryRegistry

_counter = itertools.count()


def _unique(prefix: str) -> tuple[str, str]:
    """A region name and a POSIX key no other test (or test run) uses."""
    tag = f"{prefix}_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    return tag, "/xlaserve_test_" + tag


@pytest.fixture
def regions():
    """Creates client regions; destroys them after the test even when it fails."""
    made = []

    def create(prefix: str, byte_size: int):
        name, key = _unique(prefix)
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return name, key, handle
    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _client(server) -> grpcclient.InferenceServerClient:
    c = grpcclient.InferenceServerClient(server.url)
    # What Triton's own examples do first: clear both kinds of regions unconditionally.
    c.unregister_cuda_shared_memory()
    assert not c.get_cuda_shared_memory_status().regions
    return c


def _shm_input(name, shape, datatype, region, byte_size, offset=0):
    t = grpcclient.InferInput(name, list(shape), datatype)
    t.set_shared_memory(region, byte_size, offset)
    return t


def _shm_output(name, region, byte_size, offset=0):
    o = grpcclient.InferRequestedOutput(name)
    o.set_shared_memory(region, byte_size, offset)
    return o


# ---- end to end, the happy paths --------------------------------------------------------------
def test_mlp_inputs_and_outputs_in_shared_memory(example_server, regions):
    c = _client(example_server)
    x = np.random.default_rng(7).standard_normal((4, 512)).astype(np.float32)
    in_name, in_key, in_handle = regions("mlp_in", x.nbytes)
    out_name, out_key, out_handle = regions("mlp_out", x.nbytes)
    shm.set_shared_memory_region(in_handle, [x])
    c.register_system_shared_memory(in_name, in_key, x.nbytes)
    c.register_system_shared_memory(out_name, out_key, x.nbytes)
    try:
        status = c.get_system_shared_memory_status(in_name).regions[in_name]
        assert (status.key, status.offset, status.byte_size) == (in_key, 0, x.nbytes)
        r = c.infer("mlp", [_shm_input("input", x.shape, "FP32", in_name, x.nbytes)],
                    outputs=[_shm_output("output", out_name, x.nbytes)])
        out = r.get_output("output")
        assert list(out.shape) == [4, 512] and out.datatype == "FP32"
        assert out.parameters["shared_memory_region"].string_param == out_name
        assert out.parameters["shared_memory_byte_size"].int64_param == x.nbytes
        assert r.get_response().raw_output_contents[0] == b""   # as Triton: the bytes are in the region
        got = shm.get_contents_as_numpy(out_handle, np.float32, [4, 512])
        np.testing.assert_allclose(got, reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
    finally:
        c.unregister_system_shared_memory(in_name)
        c.unregister_system_shared_memory(out_name)
    assert in_name not in c.get_system_shared_memory_status().regions


def test_image_model_one_region_with_offsets_and_inline_output(example_server, regions):
    """img_mean: both batches in one object at two offsets of a region registered at an offset;
    one output inline, one in the region, in the same run of requests."""
    c = _client(example_server)
    rng = np.random.default_rng(8)
    a = rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    b = rng.integers(0, 256, (8, 224, 224, 3), dtype=np.uint8)
    head = 4096 + 3                         # the region starts mid-page of the object
    total = head + a.nbytes + b.nbytes + 64
    name, key, handle = regions("img", total)
    shm.set_shared_memory_region(handle, [a], offset=head)
    shm.set_shared_memory_region(handle, [b], offset=head + a.nbytes)
    c.register_system_shared_memory(name, key, total - head, offset=head)
    try:
        r = c.infer("img_mean", [_shm_input("input", a.shape, "UINT8", name, a.nbytes)])
        np.testing.assert_allclose(r.as_numpy("output"), reference.img_mean_ref(a), rtol=1e-5)
        out_at = a.nbytes + b.nbytes
        r = c.infer("img_mean", [_shm_input("input", b.shape, "UINT8", name, b.nbytes, offset=a.nbytes)],
                    outputs=[_shm_output("output", name, 64, offset=out_at)])
        assert r.get_output("output").parameters["shared_memory_offset"].int64_param == out_at
        got = shm.get_contents_as_numpy(handle, np.float32, [8, 1], offset=head + out_at)
        np.testing.assert_allclose(got, reference.img_mean_ref(b), rtol=1e-5)
    finally:
        c.unregister_system_shared_memory(name)


def test_cnn_two_outputs_one_in_region_one_inline(example_server, regions):
    """tritonclient finds inline outputs by position; a region output keeps its (empty) place."""
    c = _client(example_server)
    x = np.random.default_rng(9).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    logits, label = reference.cnn_ref(x)
    name, key, handle = regions("cnn", x.nbytes + logits.nbytes)
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory(name, key, x.nbytes + logits.nbytes)
    try:
        r = c.infer("cnn", [_shm_input("input", x.shape, "UINT8", name, x.nbytes)],
                    outputs=[_shm_output("logits", name, logits.nbytes, offset=x.nbytes),
                             grpcclient.InferRequestedOutput("label")])
        np.testing.assert_array_equal(r.as_numpy("label"), label)
        got = shm.get_contents_as_numpy(handle, np.float32, list(logits.shape), offset=x.nbytes)
        np.testing.assert_allclose(got, logits, rtol=1e-4, atol=1e-5)
    finally:
        c.unregister_system_shared_memory(name)


# ---- end to end, every bad region -----------------------------------------------------------
def _expect(call, code: str, *fragments: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == code, info.value.message()
    for f in fragments:
        assert f in info.value.message(), info.value.message()


def test_bad_registrations(example_server, regions):
    c = _client(example_server)
    name, key, _ = regions("bad_reg", 1024)
    bad = "StatusCode.INVALID_ARGUMENT"
    for path_key in ("/dev/shm/" + key.lstrip("/"), "../" + key.lstrip("/"), "..", "a/b", ""):
        _expect(lambda k=path_key: c.register_system_shared_memory("r_" + name, k, 16), bad,
                "not a POSIX shared-memory object name")
    _expect(lambda: c.register_system_shared_memory("r_" + name, key + "_missing", 16), bad,
            "no shared-memory object")
    _expect(lambda: c.register_system_shared_memory("r_" + name, key, 1000, offset=100), bad,
            "offset 100 + byte_size 1000 = 1100 runs past the end", "(1024 bytes)")
    _expect(lambda: c.register_system_shared_memory("r_" + name, key, 0), bad, "byte_size > 0")
    c.register_system_shared_memory(name, key, 1024)
    try:
        _expect(lambda: c.register_system_shared_memory(name, key, 512), bad, "already registered")
        _expect(lambda: c.get_system_shared_memory_status("r_" + name), "StatusCode.NOT_FOUND",
                f"'r_{name}' is not registered")
        _expect(lambda: c.register_cuda_shared_memory("cuda_" + name, b"\0" * 64, 0, 64),
                "StatusCode.UNAVAILABLE", "CUDA shared memory is not available")
    finally:
        c.unregister_system_shared_memory(name)
    c.unregister_system_shared_memory(name)      # unknown names are fine, as in Triton


def test_bad_tensor_regions(example_server, regions):
    c = _client(example_server)
    x = np.zeros((2, 512), np.float32)
    name, key, _ = regions("bad_use", x.nbytes + 16)
    c.register_system_shared_memory(name, key, x.nbytes)        # registers 16 bytes less than exists
    bad = "StatusCode.INVALID_ARGUMENT"
    try:
        def infer(inp, out=None):
            return lambda: c.infer("mlp", [inp], outputs=[out] if out else None)
        _expect(infer(_shm_input("input", x.shape, "FP32", "nope_" + name, x.nbytes)), "StatusCode.NOT_FOUND",
                f"region 'nope_{name}' is not registered")
        _expect(infer(_shm_input("input", x.shape, "FP32", name, x.nbytes, offset=16)), bad,
                f"outside region '{name}'", f"({x.nbytes} bytes registered)")
        _expect(infer(_shm_input("input", x.shape, "FP32", name, x.nbytes - 4)), bad,
                f"expected {x.nbytes} bytes for FP32[2,512], got {x.nbytes - 4}")
        good = _shm_input("input", x.shape, "FP32", name, x.nbytes)
        _expect(infer(good, _shm_output("output", name, x.nbytes - 4)), bad,
                f"shared_memory_byte_size {x.nbytes - 4} is too small")
        _expect(infer(good, _shm_output("output", name, 8, offset=x.nbytes)), bad, "outside region")
        _expect(infer(good, _shm_output("output", "nope_" + name, x.nbytes)), "StatusCode.NOT_FOUND",
                "is not registered")
        assert c.is_server_ready()
    finally:
        c.unregister_system_shared_memory(name)


def test_disabled_by_default(tmp_path, examples_repo):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "simple").symlink_to(examples_repo / "simple")
    with serve(tmp_path / "srv", repo) as server:
        c = grpcclient.InferenceServerClient(server.url)
        for call in (lambda: c.get_system_shared_memory_status(),
                     lambda: c.register_system_shared_memory("r", "/k", 16),
                     lambda: c.unregister_system_shared_memory()):
            _expect(call, "StatusCode.FAILED_PRECONDITION", "endpoints.allow_client_shm: true")
        c.unregister_cuda_shared_memory()
        assert not c.get_cuda_shared_memory_status().regions
        t = _shm_input("INPUT0", [1, 16], "INT32", "r", 64)
        u = _shm_input("INPUT1", [1, 16], "INT32", "r", 64)
        _expect(lambda: c.infer("simple", [t, u]), "StatusCode.INVALID_ARGUMENT",
                "client shared memory is not enabled")


# ---- the registry itself (no server) --------------------------------------------------------
def _params(region: str, byte_size: int, offset: int | None = None):
    t = pb.ModelInferRequest.InferInputTensor()
    t.parameters["shared_memory_region"].string_param = region
    t.parameters["shared_memory_byte_size"].int64_param = byte_size
    if offset is not None:
        t.parameters["shared_memory_offset"].int64_param = offset
    return MappingProxyType(dict(t.parameters))


def test_unregister_while_in_flight_keeps_the_mapping_until_released(regions):
    name, key, handle = regions("inflight", 4096)
    x = np.arange(1024, dtype=np.float32)
    shm.set_shared_memory_region(handle, [x])
    registry = SharedMemoryRegistry()
    registry.register(name, key, 0, 4096)
    view = registry.read_input("input", _params(name, 4096))
    in_flight = np.frombuffer(view, dtype=np.float32)           # what the codec hands the scheduler
    del view
    assert registry.unregister(name) == [name]
    with pytest.raises(NotFound, match="is not registered"):
        registry.read_input("input", _params(name, 4096))
    np.testing.assert_array_equal(in_flight, x)                 # still mapped: the request finishes
    del in_flight                                               # the last user lets go: unmapped


def test_registry_rejects_unusual_parameters(regions):
    name, key, _ = regions("params", 64)
    registry = SharedMemoryRegistry()
    registry.register(name, key, 0, 64)
    t = pb.ModelInferRequest.InferInputTensor()
    t.parameters["shared_memory_region"].string_param = name
    with pytest.raises(InvalidArgument, match="without 'shared_memory_byte_size'"):
        registry.read_input("x", t.parameters)
    t.parameters["shared_memory_byte_size"].string_param = "8"
    with pytest.raises(InvalidArgument, match=r"must be an integer, got a string \(string_param\)"):
        registry.read_input("x", t.parameters)
    assert registry.read_input("x", _params(name, 8, 56)).nbytes == 8
    registry.close()
    assert registry.status() == []


def test_the_registry_holds_at_most_max_regions_with_names_of_bounded_length(regions, monkeypatch):
    # each region is a mapping of the worker: before the cap, a peer could register regions until
    # the process ran out of mappings (vm.max_map_count) for its own allocations too
    monkeypatch.setattr(shm_module, "MAX_REGIONS", 3)
    name, key, _ = regions("cap", 64)
    registry = SharedMemoryRegistry()
    for i in range(3):
        registry.register(f"{name}-{i}", key, 0, 64)
    with pytest.raises(ResourceExhausted, match="3 shared-memory regions are registered, the most this server keeps"):
        registry.register(f"{name}-3", key, 0, 64)
    registry.unregister(f"{name}-0")
    registry.register(f"{name}-3", key, 0, 64)      # room again
    with pytest.raises(InvalidArgument, match="is 300 characters long; at most 256"):
        registry.register("r" * 300, key, 0, 64)
    registry.close()


def test_an_object_shrunk_after_registering_is_refused_not_faulted(regions):
    """Reading mapped pages past the end of a shrunk object would SIGBUS the whole worker."""
    name, key, _ = regions("shrunk", 8192)
    registry = SharedMemoryRegistry()
    registry.register(name, key, 0, 8192)
    assert registry.read_input("x", _params(name, 4096, 4096)).nbytes == 4096
    os.truncate("/dev/shm" + key, 1024)                        # the client shrinks its object
    with pytest.raises(InvalidArgument, match=r"is now 1024 bytes, but the tensor ends at byte 8192"):
        registry.read_input("x", _params(name, 4096, 4096))
    registry.close()


def test_an_output_is_written_through_the_descriptor_and_a_full_file_system_is_an_error(regions, monkeypatch):
    """A client may register a sparse object (ftruncate makes one: no page of it written yet).
    Storing an output through the map allocates its pages, and with /dev/shm full that store
    killed the worker with SIGBUS. Outputs are written with pwrite on the object's descriptor:
    the bytes land where the client reads them, and a full file system is RESOURCE_EXHAUSTED."""
    from xlaserve.dtypes import BY_CODE
    from xlaserve.manifest import TensorDecl
    name, key, _ = regions("sparse", 1 << 20)
    path = "/dev/shm" + key
    os.truncate(path, 0)
    os.truncate(path, 1 << 20)              # sparse again: no page allocated
    registry = SharedMemoryRegistry()
    registry.register(name, key, 4096, 8192)
    decl = TensorDecl("y", BY_CODE["f32"], "cn", {"c": 4})
    out = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = pb.ModelInferResponse.InferOutputTensor()
    registry.write_output(decl, out, _params(name, 64, 128), tensor)
    with open(path, "rb") as f:
        f.seek(4096 + 128)
        assert np.frombuffer(f.read(32), np.float32).tolist() == out.ravel().tolist()
    assert tensor.parameters["shared_memory_byte_size"].int64_param == 32

    def full(fd, data, position):
        raise OSError(28, os.strerror(28))
    monkeypatch.setattr(shm_module.os, "pwrite", full)
    with pytest.raises(ResourceExhausted, match=rf"output 'y': cannot write 32 bytes into shared-memory region "
                                                rf"'{name}' .*No space left on device; the shared-memory file "
                                                r"system may be full"):
        registry.write_output(decl, out, _params(name, 64), pb.ModelInferResponse.InferOutputTensor())
    registry.close()


def test_a_region_holds_one_descriptor_and_gives_it_back(regions):
    """Each region keeps its object's descriptor open (outputs are written through it); one
    region costs the worker one descriptor besides its map's, and unregistering frees both."""
    registry = SharedMemoryRegistry()
    made = [regions(f"fd{i}", 4096)[:2] for i in range(20)]       # (the client's handles hold their own)
    after_client = len(os.listdir("/proc/self/fd"))
    for name, key in made:
        registry.register(name, key, 0, 4096)
    assert len(os.listdir("/proc/self/fd")) - after_client == 2 * 20
    registry.close()
    assert len(os.listdir("/proc/self/fd")) == after_client
