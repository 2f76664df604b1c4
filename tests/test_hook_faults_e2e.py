"""User code may raise or return anything, end to end: a real worker on loopback, the Triton
client. For each hook (preprocess, postprocess, a meta model's run) and each fault (common
exceptions, SystemExit and KeyboardInterrupt, each kind of wrong return), every request is
answered INTERNAL naming the model and the hook, a well-behaved request is served after it, the
worker lives on, and ``xlaserve_hook_failures_total{model,hook}`` counts every failure (and
reaches ``xlaserve top``). A hook past the request's deadline is answered DEADLINE_EXCEEDED by
the server while it still runs. One server for all of it: the cases are requests, not starts."""
from __future__ import annotations

import asyncio
import json
import re
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from examples.export_examples import export_simple
from tests.conftest import infer_input, serve
from xlaserve.cli import main

# The fault a hook commits, chosen by the request: a code in the first element of its input.
FAULTS_PY = '''
import pathlib
import time

import numpy as np
from xlaserve import NamedTensor

RELEASE = pathlib.Path({release!r})


class NoArray:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("no array for you")


class StrExits(Exception):
    def __str__(self):
        raise SystemExit(4)


def commit(code, good):
    """``good`` (the right list of NamedTensor), or the fault numbered ``code``."""
    if code == 0:
        return good
    if code == 5:
        return 1 / 0
    raised = {{1: KeyError("k"), 2: ValueError("v"), 3: TypeError("t"), 4: RuntimeError("r"),
              6: MemoryError("cannot allocate 1 TiB"), 7: SystemExit(7), 8: KeyboardInterrupt(),
              9: ValueError("bad \\udc80 text"), 10: StrExits()}}
    if code in raised:
        raise raised[code]
    if code == 20:
        return [NamedTensor([t.name], t.data) for t in good]          # a name that is a list
    if code == 21:
        return [NamedTensor(t.name, t.data.tolist()) for t in good]   # not an array
    if code == 22:
        return {{"nope": good[0].data}}                                  # a dict with the wrong keys
    if code == 23:
        return None
    if code == 24:
        return (t for t in good)                                        # a generator
    if code == 25:
        return [NamedTensor(t.name, NoArray()) for t in good]           # its __array__ raises
    if code == 26:
        return [NamedTensor(t.name, t.data.astype(np.float64)) for t in good]
    if code == 27:
        return [NamedTensor(t.name, t.data[..., None]) for t in good]   # a wrong shape
    if code == 99:                                                      # past any deadline
        deadline = time.monotonic() + 60
        while not RELEASE.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return good
    raise AssertionError(f"no fault {{code}}")
'''

PRE = '''
from xlaserve import register_model
from . import faults

def preprocess(tensors):
    by_name = {t.name: t for t in tensors}
    return faults.commit(int(by_name["INPUT1"].data[0, 0]), tensors)

register_model("pre_faults", preprocess=preprocess)
'''

POST = '''
from xlaserve import register_model
from . import faults

def postprocess(tensors):
    by_name = {t.name: t for t in tensors}
    return faults.commit(int(by_name["OUTPUT0"].data[0, 0]), tensors)   # INPUT0 + INPUT1, INPUT0 is 0

register_model("post_faults", postprocess=postprocess)
'''

META = '''
import numpy as np
from grpclib.const import Status
from xlaserve import NamedTensor, register_model
from xlaserve.errors import XlaserveError
from . import faults


class NotOk(XlaserveError):
    status = Status.OK


class NumberStatus(XlaserveError):
    status = 5


class SlowToSay(XlaserveError):
    def __str__(self):
        raise SystemExit(3)


class Gone(XlaserveError):
    status = Status.NOT_FOUND


RAISED = {30: NotOk("all is well"), 31: NumberStatus("five"), 32: SlowToSay(), 33: Gone("no such thing here")}


def run(tensors, ctx):
    x = tensors[0].data
    code = int(x[0])
    if code in RAISED:
        raise RAISED[code]
    if code >= 100:             # a sub-call whose sub-model's postprocess commits fault code - 100
        second = np.full((1, 16), code - 100, np.int32)
        ctx.infer("post_faults", {"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": second})
        code = 0
    return faults.commit(code, [NamedTensor("y", x)])

register_model("meta_faults", run=run)
'''

META_MANIFEST = """format_version: "2.0"
kind: meta
client_inputs:
  - {name: x, dtype: f32, shape: n}
client_outputs:
  - {name: y, dtype: f32, shape: n}
"""

RAISED = {1: "KeyError: 'k'", 2: "ValueError: v", 3: "TypeError: t", 4: "RuntimeError: r",
          5: "ZeroDivisionError: division by zero", 6: "MemoryError: cannot allocate 1 TiB",
          7: "SystemExit: 7", 8: "KeyboardInterrupt: ",
          # a lone surrogate, which UTF-8 cannot encode: the call ended without trailers, its client waited for good
          9: "ValueError: bad \\udc80 text",
          # __str__ raises SystemExit: it left the guard describing the failure and stopped the worker
          10: "StrExits: <StrExits whose str() raised>"}
RETURNED = {20: "a tensor's name must be a str, found list", 21: "expected a NumPy array",
            22: "unexpected tensor(s) 'nope'", 23: "expected a list of NamedTensor, found NoneType",
            24: "expected a list of NamedTensor, found generator", 25: "expected a NumPy array",
            26: "expected dtype", 27: "expected shape"}
HOOKS = {"pre_faults": "preprocess", "post_faults": "postprocess", "meta_faults": "run"}


def _inputs(model: str, code: int, client=grpcclient) -> list:
    if model == "meta_faults":
        return [infer_input("x", np.array([code, 1, 2], np.float32), "FP32", client)]
    return [infer_input("INPUT0", np.zeros((1, 16), np.int32), "INT32", client),
            infer_input("INPUT1", np.full((1, 16), code, np.int32), "INT32", client)]


def _served(client, model: str) -> None:
    """A well-behaved request to ``model``, answered right."""
    r = client.infer(model, _inputs(model, 0))
    if model == "meta_faults":
        np.testing.assert_array_equal(r.as_numpy("y"), [0, 1, 2])
    else:
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.zeros((1, 16), np.int32))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook_faults")
    repo = root / "models"
    release = root / "release"
    export_simple(repo, (1, 2, 4, 8))
    for name, source in (("pre_faults", PRE), ("post_faults", POST)):
        bundle = shutil.copytree(repo / "simple", repo / name)
        manifest = bundle / "manifest.yaml"
        manifest.write_text(manifest.read_text().replace("name: simple", f"name: {name}"))
        (bundle / "model.py").write_text(source)
        (bundle / "faults.py").write_text(FAULTS_PY.format(release=str(release)))
    meta = repo / "meta_faults"
    meta.mkdir()
    (meta / "manifest.yaml").write_text(META_MANIFEST)
    (meta / "model.py").write_text(META)
    (meta / "faults.py").write_text(FAULTS_PY.format(release=str(release)))
    with serve(root / "server", repo) as running:
        running.release = release
        yield running
    assert running.process.returncode == 0, running.log()


def _hook_failures(server) -> dict[tuple[str, str], float]:
    """``xlaserve_hook_failures_total`` by (model, hook), from the worker's /metrics."""
    status, body = server.get("/metrics")
    assert status == 200
    counts = {}
    for labels, n in re.findall(r'^xlaserve_hook_failures_total\{([^}]*)\} (\S+)$', body, re.M):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[named["model"], named["hook"]] = float(n)
    return counts


@pytest.mark.parametrize("model", list(HOOKS))
def test_every_fault_of_user_code_is_internal_naming_model_and_hook_and_counted(server, model):
    hook = HOOKS[model]
    c = grpcclient.InferenceServerClient(server.url)
    before = _hook_failures(server).get((model, hook), 0.0)
    for code, expected in {**RAISED, **RETURNED}.items():
        with pytest.raises(InferenceServerException) as info:
            c.infer(model, _inputs(model, code), client_timeout=20)
        assert info.value.status() == "StatusCode.INTERNAL", (code, info.value)
        message = info.value.message()
        if code in RAISED:
            assert message == f"model '{model}': {hook} hook raised {expected}", code
        else:
            assert message.startswith(f"model '{model}': {hook} hook output (checked against "), (code, message)
            assert expected in message, (code, message)
        _served(c, model)           # the worker goes on: a well-behaved request right after
    assert _hook_failures(server)[(model, hook)] - before == len(RAISED) + len(RETURNED)
    assert server.process.poll() is None
    log = server.log()
    assert f"model '{model}': {hook} hook raised ZeroDivisionError" in log and "Traceback" in log


def test_the_issue_case_a_list_as_a_name_answers_all_eight_requests(server):
    """8 requests at once to a postprocess that returns a NamedTensor whose name is a list: all
    8 answered (3 of 8 were never answered before the fix)."""
    async def main_():
        client = aioclient.InferenceServerClient(server.url)
        try:
            async def one():
                try:
                    return await client.infer("post_faults", _inputs("post_faults", 20, aioclient),
                                              client_timeout=20)
                except InferenceServerException as exc:
                    return exc
            return await asyncio.gather(*(one() for _ in range(8)))
        finally:
            await client.close()
    results = asyncio.run(main_())
    assert [r.status() for r in results] == ["StatusCode.INTERNAL"] * 8
    assert all("a tensor's name must be a str, found list ['OUTPUT0']" in r.message() for r in results)
    _served(grpcclient.InferenceServerClient(server.url), "post_faults")


def test_an_xlaserve_error_raised_by_run_keeps_its_status_only_if_a_call_can_end_with_it(server):
    """run may raise xlaserve's errors, its own subclasses included: their status and message
    are read in run's thread. Before, they were read where the call ends, on the Trio thread:
    status OK answered OK with no outputs, a status that was a number answered 'internal error
    in answering the request', and a __str__ that raised left the call unanswered."""
    c = grpcclient.InferenceServerClient(server.url)
    before = _hook_failures(server).get(("meta_faults", "run"), 0.0)
    expected = {
        30: ("INTERNAL", "model 'meta_faults': run hook raised NotOk whose status, <Status.OK: 0>, is not an error "
                         "status (a grpclib.const.Status other than OK): all is well"),
        31: ("INTERNAL", "model 'meta_faults': run hook raised NumberStatus whose status, 5, is not an error status "
                         "(a grpclib.const.Status other than OK): five"),
        32: ("INTERNAL", "model 'meta_faults': run hook raised SlowToSay: <SlowToSay whose str() raised>"),
        33: ("NOT_FOUND", "no such thing here"),
    }
    for code, (status, message) in expected.items():
        with pytest.raises(InferenceServerException) as info:
            c.infer("meta_faults", _inputs("meta_faults", code), client_timeout=20)
        assert (info.value.status(), info.value.message()) == (f"StatusCode.{status}", message), code
        _served(c, "meta_faults")
    assert _hook_failures(server)[("meta_faults", "run")] - before == 3
    assert server.process.poll() is None


def test_a_sub_model_hook_failing_under_ctx_infer_counts_under_the_sub_model(server):
    c = grpcclient.InferenceServerClient(server.url)
    before = _hook_failures(server)
    with pytest.raises(InferenceServerException) as info:
        c.infer("meta_faults", _inputs("meta_faults", 101))
    assert info.value.status() == "StatusCode.INTERNAL"
    assert info.value.message() == ("model 'meta_faults': run: ctx.infer('post_faults'): model 'post_faults': "
                                    "postprocess hook raised KeyError: 'k'")
    after = _hook_failures(server)
    assert after[("post_faults", "postprocess")] - before.get(("post_faults", "postprocess"), 0) == 1
    assert after.get(("meta_faults", "run"), 0) == before.get(("meta_faults", "run"), 0)
    c.infer("meta_faults", _inputs("meta_faults", 100))       # a good sub-call: served


def test_a_hook_past_the_deadline_is_answered_by_the_server_while_it_runs(server):
    """Triton's ``timeout`` parameter (no gRPC deadline, so the client does not give up on its
    own): the server answers DEADLINE_EXCEEDED while the hook still waits for the release
    file; once released, its late result goes nowhere and the model serves again."""
    c = grpcclient.InferenceServerClient(server.url)
    try:
        for model, hook in HOOKS.items():
            with pytest.raises(InferenceServerException) as info:
                c.infer(model, _inputs(model, 99), request_id="late", timeout=300_000)   # 0.3 s, in us
            assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED", info.value
            assert f"model '{model}': request 'late': the deadline passed before its {hook} hook returned" in \
                info.value.message()
        assert not server.release.exists()      # every hook was still running when answered
    finally:
        server.release.touch()
    for model in HOOKS:
        _served(c, model)


def test_top_shows_the_hook_failures(server, capsys):
    c = grpcclient.InferenceServerClient(server.url)
    for model in HOOKS:
        with pytest.raises(InferenceServerException):
            c.infer(model, _inputs(model, 1))
    assert main(["top", "--once", "--json", server.url]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    counted = _hook_failures(server)
    for model, hook in HOOKS.items():
        assert models[model]["hook_failures"][hook] == counted[(model, hook)] > 0
    assert models["simple"]["hook_failures"] == {}
