"""Restricted API groups (``endpoints.restricted``) and client shared memory only from allowed
peers (``endpoints.client_shm_peers``), issue 14 part 4: the group table, config validation, and
end to end with the real server and the real Triton client. A client "from 127.0.0.2" goes
through a relay whose upstream socket is bound to 127.0.0.2, so the server sees that peer."""
from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import threading
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from examples.export_examples import export_simple
from tests.conftest import serve
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.config import ConfigError
from xlaserve.config.resolve import effective_config_lines, parse_node_config, resolve_worker
from xlaserve.config.schema import RestrictedApi
from xlaserve.config.access import GROUPS, PATH_GROUPS, header_name_problem
from xlaserve.frontend.access import AccessPolicy, peer_address, shm_peer_denial
from xlaserve.frontend.control import WorkerControlService
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.frontend.kserve import KServeService

ADMIN_HEADER, ADMIN_VALUE = "x-xlaserve-admin", "s3cret admin token"
STATS_HEADER, STATS_VALUE = "x-stats-key", "stats-key-7"
TRITON_GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
                 "statistics", "trace", "logging")


# ---- the group table -----------------------------------------------------------------------------
def _served_paths() -> list[str]:
    """Every RPC path the worker serves, as GrpcServer enumerates them from the two services the
    worker builds (their handlers are not called, so the instances need no worker behind them)."""
    services = [KServeService.__new__(KServeService), WorkerControlService.__new__(WorkerControlService)]
    return list(GrpcServer(services).methods)


def test_every_served_rpc_is_in_exactly_one_api_group():
    paths = _served_paths()
    assert len(paths) == 25         # 20 KServe (Triton) RPCs and 5 WorkerControl RPCs
    for path in paths:
        groups = [g for g, rpcs in GROUPS.items() if any(path == f"/{s}/{r}" for s, r in rpcs)]
        assert len(groups) == 1, f"{path} is in API groups {groups}"
    assert set(PATH_GROUPS) == set(paths)      # and the table names nothing that is not served


def test_the_groups_are_tritons_and_control_holds_the_whole_control_service():
    assert tuple(GROUPS) == (*TRITON_GROUPS, "control")
    control = {p for p in _served_paths() if p.startswith("/xlaserve.control.WorkerControl/")}
    assert {p for p, g in PATH_GROUPS.items() if g == "control"} == control
    assert PATH_GROUPS["/inference.GRPCInferenceService/ModelInfer"] == "inference"
    assert PATH_GROUPS["/inference.GRPCInferenceService/RepositoryModelLoad"] == "model-repository"
    assert PATH_GROUPS["/inference.GRPCInferenceService/SystemSharedMemoryRegister"] == "shared-memory"
    assert PATH_GROUPS["/inference.GRPCInferenceService/LogSettings"] == "logging"


def test_a_served_rpc_in_no_group_stops_the_server_from_being_built():
    class Extra:
        def __mapping__(self):
            return {"/inference.GRPCInferenceService/ModelExplain": object(), "/grpc.health.v1.Health/Check": object()}
    with pytest.raises(ValueError, match=r"served RPCs in no API group: /grpc.health.v1.Health/Check, "
                                         r"/inference.GRPCInferenceService/ModelExplain; add each"):
        GrpcServer([Extra()], access=AccessPolicy())
    GrpcServer([Extra()])       # a server built without a policy (tests, tools) checks nothing


def test_rules_apply_to_the_restricted_groups_only_and_name_the_group_and_header_never_the_value():
    policy = AccessPolicy.from_config([RestrictedApi(("model-repository", "control"), "x-key", "v@lue 1"),
                                       RestrictedApi(("inference",), "x-infer", "i")])
    rules = policy.for_methods(_served_paths())
    assert {PATH_GROUPS[p] for p in rules} == {"model-repository", "control", "inference"}
    assert len(rules) == 3 + 5 + 2
    rule = rules["/inference.GRPCInferenceService/RepositoryModelLoad"]
    assert rule.denial({"x-key": "v@lue 1"}) is None
    missing = rule.denial({})
    assert missing == ("the 'model-repository' API group is restricted on this server (endpoints.restricted); the "
                       "call came without header 'x-key', which must carry the value configured for it")
    wrong = rule.denial({"x-key": "v@lue 2"})
    assert "with a wrong value in header 'x-key'" in wrong and "v@lue" not in wrong
    assert rule.denial({"x-key": "v@lue 1\u00e9"}) is not None     # non-ASCII is compared, not a TypeError
    assert rule.denial({"x-other": "v@lue 1"}) is not None
    assert "v@lue" not in repr(rule)


@pytest.mark.parametrize("name, why", [
    ("", "the header name is empty"),
    (":authority", "is an HTTP/2 pseudo-header"),
    ("X-Key", "is not a valid HTTP/2 header name"),
    ("x key", "is not a valid HTTP/2 header name"),
    ("grpc-timeout", "names starting with 'grpc-' belong to gRPC"),
    ("x-token-bin", "binary (base64) gRPC header"),
    ("content-type", "reserved for the HTTP/2 and gRPC layers"),
    ("te", "reserved for the HTTP/2 and gRPC layers"),
    ("user-agent", "reserved for the HTTP/2 and gRPC layers"),
])
def test_header_names_that_cannot_carry_a_key(name, why):
    assert why in header_name_problem(name)


def test_header_names_that_can():
    for name in ("x-api-key", "authorization", "x_key.1"):
        assert header_name_problem(name) is None


# ---- config ---------------------------------------------------------------------------------------
def _endpoints(**keys):
    return parse_node_config({"model_repo": "/tmp", "global": {"endpoints": keys}}, "/tmp").endpoints


def test_config_defaults_restrict_nothing_and_allow_loopback_shm_only():
    endpoints = _endpoints()
    assert endpoints.restricted == ()
    assert endpoints.client_shm_peers == (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def test_config_reads_restricted_entries_and_networks_and_never_logs_the_value():
    node = parse_node_config({"model_repo": "/tmp", "global": {"endpoints": {
        "restricted": [{"groups": ["control", "model-repository"], "header": "x-admin", "value": "hunter2"}],
        "client_shm_peers": ["10.1.0.0/16", "fd00::/8", "192.168.1.7"]}}}, "/tmp")
    assert node.endpoints.restricted == (RestrictedApi(("control", "model-repository"), "x-admin", "hunter2"),)
    assert [str(n) for n in node.endpoints.client_shm_peers] == ["10.1.0.0/16", "fd00::/8", "192.168.1.7/32"]
    lines = "\n".join(effective_config_lines(resolve_worker(node, 0)))
    assert "hunter2" not in lines and "value: <redacted>" in lines and "- fd00::/8" in lines
    assert "hunter2" not in repr(node)


@pytest.mark.parametrize("endpoints, message", [
    ({"restricted": [{"groups": ["admin"], "header": "x-k", "value": "v"}]},
     "global.endpoints.restricted[0].groups: unknown API group 'admin' (valid: health, metadata, inference, "
     "shared-memory, model-config, model-repository, statistics, trace, logging, control)"),
    ({"restricted": [{"groups": ["trace"], "header": "x-a", "value": "v"},
                     {"groups": ["logging", "trace"], "header": "x-b", "value": "w"}]},
     "global.endpoints.restricted[1].groups: API group 'trace' is restricted twice (also in entry [0])"),
    ({"restricted": [{"groups": ["trace", "trace"], "header": "x-a", "value": "v"}]},
     "API group 'trace' is restricted twice (earlier in this entry)"),
    ({"restricted": [{"groups": [], "header": "x-a", "value": "v"}]},
     "global.endpoints.restricted[0].groups: expected a non-empty list of API groups"),
    ({"restricted": [{"groups": ["trace"], "header": "", "value": "v"}]},
     "global.endpoints.restricted[0].header: the header name is empty"),
    ({"restricted": [{"groups": ["trace"], "header": "grpc-secret", "value": "v"}]},
     "global.endpoints.restricted[0].header: 'grpc-secret' is reserved"),
    ({"restricted": [{"groups": ["trace"], "header": "Api-Key", "value": "v"}]},
     "global.endpoints.restricted[0].header: 'Api-Key' is not a valid HTTP/2 header name"),
    ({"restricted": [{"groups": ["trace"], "header": "x-k", "value": 1234}]},
     "global.endpoints.restricted[0].value: expected a string (quote it"),
    ({"restricted": [{"groups": ["trace"], "header": "x-k", "value": "two\nlines"}]},
     "global.endpoints.restricted[0].value: the header value must be printable ASCII"),
    ({"restricted": [{"groups": ["trace"], "header": "x-k"}]},
     "global.endpoints.restricted[0].value: required (an entry sets groups, header, value)"),
    ({"restricted": [{"groups": ["trace"], "header": "x-k", "value": "v", "key": "x"}]},
     "global.endpoints.restricted[0].key: unknown key (known: groups, header, value)"),
    ({"restricted": {"groups": ["trace"]}},
     "global.endpoints.restricted: expected a list of {groups, header, value} entries, got a mapping"),
    ({"client_shm_peers": ["10.0.0.1/8"]},
     "global.endpoints.client_shm_peers[0]: '10.0.0.1/8' is not a network in CIDR notation such as "
     "'127.0.0.0/8' or '::1/128' (10.0.0.1/8 has host bits set)"),
    ({"client_shm_peers": ["localhost"]}, "global.endpoints.client_shm_peers[0]: 'localhost' is not a network"),
    ({"client_shm_peers": [8]}, "global.endpoints.client_shm_peers[0]: expected a network in CIDR notation"),
    ({"client_shm_peers": "127.0.0.0/8"},
     "global.endpoints.client_shm_peers: expected a list of networks in CIDR notation, got '127.0.0.0/8'"),
])
def test_config_errors_name_the_key_and_what_was_expected(endpoints, message):
    with pytest.raises(ConfigError) as err:
        _endpoints(**endpoints)
    assert message in str(err.value)
    assert "hunter2" not in str(err.value)


def test_config_errors_in_a_worker_block_name_the_worker_path():
    with pytest.raises(ConfigError, match=r"^workers\[0\]\.endpoints\.restricted\[0\]\.groups: unknown API group"):
        parse_node_config({"model_repo": "/tmp", "workers": [{"name": "w0", "endpoints": {
            "restricted": [{"groups": ["everything"], "header": "x-k", "value": "v"}]}}]}, "/tmp")


def test_restricted_and_client_shm_peers_cannot_come_from_the_environment():
    for var in ("INFERENCE_SERVER_ENDPOINTS_RESTRICTED", "INFERENCE_SERVER_ENDPOINTS_CLIENT_SHM_PEERS"):
        with pytest.raises(ConfigError, match=f"{var}: unknown variable"):
            parse_node_config({"model_repo": "/tmp"}, "/tmp", {var: "x"})


# ---- peers ----------------------------------------------------------------------------------------
def test_peer_addresses_from_getpeername():
    assert peer_address(("127.0.0.2", 5000)) == ipaddress.ip_address("127.0.0.2")
    assert peer_address(("::1", 5000, 0, 0)) == ipaddress.ip_address("::1")
    # an IPv4 client of a dual-stack listener is judged by its IPv4 address
    assert peer_address(("::ffff:10.0.0.9", 5000, 0, 0)) == ipaddress.ip_address("10.0.0.9")
    assert peer_address("") is None and peer_address(b"\0abstract") is None


def test_shm_peer_denial_names_the_peer_and_the_key():
    loopback = _endpoints().client_shm_peers
    assert shm_peer_denial("SystemSharedMemoryRegister", ipaddress.ip_address("127.9.9.9"), loopback) is None
    assert shm_peer_denial("X", ipaddress.ip_address("::1"), loopback) is None
    assert shm_peer_denial("X", ipaddress.ip_address("10.0.0.9"), loopback) == (
        "X: client shared memory is accepted only from peers in endpoints.client_shm_peers (127.0.0.0/8, "
        "::1/128); this call comes from peer 10.0.0.9")
    assert "a peer with no IP address" in shm_peer_denial("X", None, loopback)
    assert "(none)" in shm_peer_denial("X", ipaddress.ip_address("127.0.0.1"), ())


# ---- end to end -----------------------------------------------------------------------------------
class SourceRelay:
    """Forwards connections accepted on 127.0.0.1:``port`` to ``target`` from a socket bound to
    ``source``: a client of the relay reaches the server as a peer at ``source``."""

    def __init__(self, target: tuple[str, int], source: str) -> None:
        self.target, self.source = target, source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:          # the listener was shut down
                return
            upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                self.threads.append(t)
                t.start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def __enter__(self) -> "SourceRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in list(self.sockets):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(10)
        for s in self.sockets:
            s.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """model-repository and control behind one header, statistics behind another; client shared
    memory on, from 127.0.0.1 only."""
    tmp = tmp_path_factory.mktemp("access")
    repo = tmp / "models"
    export_simple(repo, (1,))
    with serve(tmp / "srv", repo, {"model_control_mode": "explicit", "cache_dir": None, "endpoints": {
            "allow_client_shm": True, "client_shm_peers": ["127.0.0.1/32"],
            "restricted": [{"groups": ["model-repository", "control"], "header": ADMIN_HEADER, "value": ADMIN_VALUE},
                           {"groups": ["statistics"], "header": STATS_HEADER, "value": STATS_VALUE}]}},
               wait_ready=False) as running:
        yield running
    assert running.process.returncode == 0, running.log()


@pytest.fixture
def client(server):
    c = grpcclient.InferenceServerClient(server.url)
    yield c
    c.close()


def _loaded(server, client) -> None:
    if not client.is_model_ready("simple"):
        client.load_model("simple", headers={ADMIN_HEADER: ADMIN_VALUE})


def _denied(call, *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as err:
        call()
    assert err.value.status() == "StatusCode.PERMISSION_DENIED", err.value
    for fragment in fragments:
        assert fragment in err.value.message()
    return err.value.message()


def _simple_inputs(a: np.ndarray, b: np.ndarray):
    ins = []
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        t = grpcclient.InferInput(name, list(array.shape), "INT32")
        t.set_data_from_numpy(array)
        ins.append(t)
    return ins


def test_a_restricted_group_needs_its_header_and_value(server, client):
    if client.is_model_ready("simple"):
        client.unload_model("simple", headers={ADMIN_HEADER: ADMIN_VALUE})
    message = _denied(lambda: client.load_model("simple"), "'model-repository' API group is restricted",
                      f"without header '{ADMIN_HEADER}'")
    assert ADMIN_VALUE not in message
    _denied(lambda: client.load_model("simple", headers={ADMIN_HEADER: "guess"}),
            f"with a wrong value in header '{ADMIN_HEADER}'")
    _denied(lambda: client.load_model("simple", headers={STATS_HEADER: STATS_VALUE}), ADMIN_HEADER)
    _denied(lambda: client.get_model_repository_index(), "'model-repository' API group")
    assert not client.is_model_ready("simple")       # the refused loads never reached a handler
    client.load_model("simple", headers={ADMIN_HEADER: ADMIN_VALUE})
    assert client.is_model_ready("simple")
    index = client.get_model_repository_index(headers={ADMIN_HEADER: ADMIN_VALUE})
    assert [m.name for m in index.models] == ["simple"]
    # a second entry, a second header: statistics is not opened by the admin header
    _denied(lambda: client.get_inference_statistics("simple", headers={ADMIN_HEADER: ADMIN_VALUE}),
            "'statistics' API group", STATS_HEADER)
    stats = client.get_inference_statistics("simple", headers={STATS_HEADER: STATS_VALUE})
    assert stats.model_stats[0].name == "simple"


def test_unrestricted_groups_need_no_header(server, client):
    _loaded(server, client)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer("simple", _simple_inputs(a, a))          # inference: not restricted
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
    assert client.is_server_live() and client.is_model_ready("simple")            # health
    assert client.get_model_metadata("simple").name == "simple"                    # metadata
    assert client.get_model_config("simple").config.name == "simple"               # model-config


def test_the_control_group_needs_the_header_on_the_control_service(server):
    with grpc.insecure_channel(server.url) as channel:
        status = channel.unary_unary("/xlaserve.control.WorkerControl/ModelControlStatus",
                                     request_serializer=cpb.ModelControlStatusRequest.SerializeToString,
                                     response_deserializer=cpb.ModelControlStatusResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            status(cpb.ModelControlStatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'control' API group" in err.value.details() and ADMIN_HEADER in err.value.details()
        reply = status(cpb.ModelControlStatusRequest(), timeout=10, metadata=[(ADMIN_HEADER, ADMIN_VALUE)])
        assert reply.worker


_counter = itertools.count()


@pytest.fixture
def region():
    """A 128-byte client region (two [1, 16] int32 tensors); destroyed after the test."""
    tag = f"access_{os.getpid()}_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    handle = shm.create_shared_memory_region(tag, "/xlaserve_test_" + tag, 128)
    yield tag, "/xlaserve_test_" + tag, handle
    shm.destroy_shared_memory_region(handle)


def test_shared_memory_from_an_allowed_peer(server, client, region):
    _loaded(server, client)
    name, key, handle = region
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [a, 3 * a])
    client.register_system_shared_memory(name, key, 128)
    try:
        assert client.get_system_shared_memory_status(name).regions[name].key == key
        ins = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        ins[0].set_shared_memory(name, 64)
        ins[1].set_shared_memory(name, 64, offset=64)
        result = client.infer("simple", ins)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 4 * a)
    finally:
        client.unregister_system_shared_memory(name)


def test_shared_memory_is_refused_to_a_peer_outside_client_shm_peers(server, client, region):
    _loaded(server, client)
    name, key, handle = region
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [a, a])
    client.register_system_shared_memory(name, key, 128)     # from 127.0.0.1: the region exists
    peer = "this call comes from peer 127.0.0.2"
    try:
        with SourceRelay(("127.0.0.1", server.grpc_port), "127.0.0.2") as relay:
            remote = grpcclient.InferenceServerClient(f"127.0.0.1:{relay.port}")
            try:
                other, other_key = name + "_remote", key + "_remote"
                message = _denied(lambda: remote.register_system_shared_memory(other, other_key, 64),
                                  "SystemSharedMemoryRegister: client shared memory is accepted only from peers in "
                                  "endpoints.client_shm_peers (127.0.0.1/32)", peer)
                assert "/dev/shm" not in message
                _denied(lambda: remote.get_system_shared_memory_status(), "SystemSharedMemoryStatus", peer)
                _denied(lambda: remote.unregister_system_shared_memory(name), "SystemSharedMemoryUnregister", peer)
                # a request naming the region (an input, or an output) is refused before it runs
                ins = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
                ins[0].set_shared_memory(name, 64)
                ins[1].set_shared_memory(name, 64, offset=64)
                _denied(lambda: remote.infer("simple", ins), "ModelInfer: client shared memory", peer)
                out = grpcclient.InferRequestedOutput("OUTPUT0")
                out.set_shared_memory(name, 64)
                _denied(lambda: remote.infer("simple", _simple_inputs(a, a), outputs=[out]), "ModelInfer", peer)
                # the same peer is served otherwise
                np.testing.assert_array_equal(remote.infer("simple", _simple_inputs(a, a)).as_numpy("OUTPUT0"), 2 * a)
            finally:
                remote.close()
        # nothing the refused calls asked for happened: the region is still registered, no other was
        status = client.get_system_shared_memory_status()
        assert set(status.regions) == {name}
        assert shm.get_contents_as_numpy(handle, np.int32, [1, 16]).tolist() == a.tolist()
    finally:
        client.unregister_system_shared_memory(name)

