"""Python hooks without a server: what hooks return is checked against the manifest, model.py is
imported in isolation, the CORAL postprocess counts leading positive logits, and meta sub-calls
enter the scheduler with the meta request's deadline."""
from __future__ import annotations

import functools
import gc
import shutil
import sys
import threading
import time
import weakref
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing

from examples import reference
from xlaserve._hooks import NamedTensor, conform
from xlaserve.bundle import ModelVersion, import_hooks
from xlaserve.codec import serialize_bytes
from xlaserve.errors import BundleError, Cancelled, DeadlineExceeded, InternalError, XlaserveError
from xlaserve.manifest import parse_manifest
from xlaserve.worker.inference import ClientRequest, InferenceService, SubCallError, call_hook
from xlaserve.worker.messages import CancelRequest, InferRequest, InferResult
from xlaserve.worker.registry import ModelEntry, ModelState, ModelTable

HOOKS = Path(__file__).resolve().parent.parent / "examples" / "hooks"


def _manifest(name: str, **extra):
    data = {"format_version": "2.0", "name": name,
            "executable_inputs": [{"name": "x", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
            "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
            "batching": {"compiled_batch_sizes": [1, 4]}}
    data.update(extra)
    return parse_manifest(data, name)


GRADE_OUT = _manifest("g", client_outputs=[{"name": "grade", "dtype": "i64", "shape": "yn", "dims": {"y": 1}},
                                           {"name": "label", "dtype": "bytes", "shape": "yn", "dims": {"y": 1}}])


# ---- conform: what hooks return, checked against the manifest ------------------------------
def test_conform_accepts_declared_tensors_and_bytes_as_object_or_numpy_strings():
    grade = np.zeros((3, 1), np.int64)
    for label in (np.array([[b"a"], [b"b"], ["c"]], dtype=object), np.array([[b"a"], [b"b"], [b"c"]])):
        out, rows = conform([NamedTensor("label", label), NamedTensor("grade", grade)], GRADE_OUT.client_outputs,
                            where="w", rows=3)
        assert list(out) == ["grade", "label"] and rows == 3


@pytest.mark.parametrize("returned, message", [
    ([NamedTensor("grade", np.zeros((3, 1), np.float64)), NamedTensor("label", np.full((3, 1), b"x"))],
     "tensor 'grade': expected dtype INT64 (INT64[3,1]), found FP64[3,1]"),
    ([NamedTensor("grade", np.zeros((2, 1), np.int64)), NamedTensor("label", np.full((3, 1), b"x"))],
     "tensor 'grade': expected shape INT64[3,1], found INT64[2,1]"),
    ([NamedTensor("grade", np.zeros((3, 1), np.int64))], "missing tensor(s) 'label'"),
    ([NamedTensor("grade", np.zeros((3, 1), np.int64)), NamedTensor("label", np.full((3, 1), b"x")),
      NamedTensor("extra", np.zeros(3))], "unexpected tensor(s) 'extra'"),
    ([NamedTensor("grade", [[1], [2], [3]]), NamedTensor("label", np.full((3, 1), b"x"))],
     "tensor 'grade': expected a NumPy array INT64[3,1], found list"),
    ([NamedTensor("grade", np.zeros((3, 1), np.int64)), NamedTensor("label", np.array([[1], [2], [3]], object))],
     "tensor 'label': expected dtype BYTES"),
    ({"grade": np.zeros((3, 1), np.int64)}.values(), "expected a list of NamedTensor, found dict_values"),
    ([("grade", np.zeros((3, 1)))], "expected a list of NamedTensor, found an element of type tuple"),
])
def test_conform_names_the_tensor_expected_and_found(returned, message):
    with pytest.raises(InternalError) as info:
        conform(returned, GRADE_OUT.client_outputs, where="model 'g': postprocess hook output", rows=3)
    assert str(info.value).startswith("model 'g': postprocess hook output: ")
    assert message in str(info.value)



class _LoudStr(str):
    def __str__(self):
        raise AssertionError("a BYTES element's __str__ ran after conform: user code where the reply is encoded")


class _LoudBytes(bytes):
    def __len__(self):
        raise AssertionError("a BYTES element's __len__ ran after conform: user code where the reply is encoded")


class _LoudArray(np.ndarray):
    @property
    def shape(self):
        raise AssertionError("an ndarray subclass's shape ran after conform: user code where the reply is encoded")


def test_conform_hands_on_plain_arrays_and_bytes_so_encoding_the_reply_runs_no_user_code():
    """The reply is encoded on the Trio thread: what a hook returned must not run code there (a
    ``__str__`` that sleeps stalled every model of the worker) nor fail there (a lone surrogate
    was INTERNAL 'answering the request failed', logged with a traceback on every request)."""
    grade = np.arange(3, dtype=np.int64).reshape(3, 1)
    label = np.array([[_LoudStr("a")], [_LoudBytes(b"b")], ["c"]], dtype=object)
    out, _ = conform([NamedTensor("grade", grade.view(_LoudArray)), NamedTensor("label", label)],
                     GRADE_OUT.client_outputs, where="w", rows=3)
    assert type(out["grade"]) is np.ndarray and out["grade"].tolist() == [[0], [1], [2]]
    assert [type(b) for b in out["label"].reshape(-1)] == [bytes] * 3
    assert serialize_bytes(out["label"]) == b"\x01\x00\x00\x00a\x01\x00\x00\x00b\x01\x00\x00\x00c"
    out, _ = conform([NamedTensor("grade", np.ma.masked_array(grade, mask=True)), NamedTensor("label", np.array([["é"]] * 3))],
                     GRADE_OUT.client_outputs, where="w", rows=3)
    assert type(out["grade"]) is np.ndarray and out["label"].tolist() == [["é".encode()]] * 3
    with pytest.raises(InternalError) as info:
        conform([NamedTensor("grade", grade), NamedTensor("label", np.array([["ok"], ["\udc80"], ["x"]]))],
                GRADE_OUT.client_outputs, where="model 'g': postprocess hook output", rows=3)
    assert str(info.value) == ("model 'g': postprocess hook output: tensor 'label': element 1 is a str that UTF-8 "
                               "cannot encode (surrogates not allowed at position 0); expected bytes or a str of "
                               "Unicode characters")

def test_conform_rows_from_the_batch_axis_and_free_rows_for_meta_outputs():
    decls = _manifest("m").executable_inputs
    _, rows = conform({"x": np.zeros((3, 4), np.float32)}, decls, where="w", rows=None, max_rows=4)
    assert rows == 3
    with pytest.raises(InternalError, match=r"at most 4 \(the largest compiled batch size\), found FP32\[5,4\]"):
        conform({"x": np.zeros((5, 4), np.float32)}, decls, where="w", rows=None, max_rows=4)
    with pytest.raises(InternalError, match="must be at least 1"):
        conform({"x": np.zeros((0, 4), np.float32)}, decls, where="w", rows=None)
    out, _ = conform({"x": np.zeros((0, 4), np.float32)}, decls, where="w", rows=None, any_rows=True)
    assert out["x"].shape == (0, 4)


def test_call_hook_names_model_hook_and_exception():
    model = SimpleNamespace(name="grader")

    def broken(tensors):
        raise ValueError("no logits today")
    with pytest.raises(InternalError, match=r"^model 'grader': postprocess hook raised ValueError: no logits today$"):
        call_hook(model, "postprocess", broken, {"y": np.zeros((1, 4), np.float32)}, GRADE_OUT.client_outputs, 1)
    with pytest.raises(InternalError, match=r"model 'grader': postprocess hook output \(checked against "
                                            r"client_outputs\): expected a list of NamedTensor, found NoneType"):
        call_hook(model, "postprocess", lambda t: None, {}, GRADE_OUT.client_outputs, 1)


# ---- import_hooks: isolation and reload ---------------------------------------------------
def _bundle(root: Path, name: str, hooks: str, helper: str | None = None, **manifest) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.py").write_text(hooks)
    if helper is not None:
        (path / "helpers.py").write_text(helper)
    return path


HOOK_WITH_HELPER = """
from xlaserve import NamedTensor, register_model
from . import helpers
import numpy as np

def postprocess(outputs):
    return [NamedTensor("y", outputs[0].data + np.float32(helpers.OFFSET))]

register_model({name!r}, postprocess=postprocess)
"""


def _offset_of(reg) -> float:
    (out,) = reg.postprocess([NamedTensor("y", np.zeros((1, 4), np.float32))])
    return float(out.data[0, 0])


def test_each_bundle_imports_its_own_helpers_and_a_reload_reimports(tmp_path):
    a = _bundle(tmp_path, "a", HOOK_WITH_HELPER.format(name="a"), "OFFSET = 1")
    b = _bundle(tmp_path, "b", HOOK_WITH_HELPER.format(name="b"), "OFFSET = 2")
    reg_a = import_hooks(a, _manifest("a"), 1)
    reg_b = import_hooks(b, _manifest("b"), 1)
    assert (_offset_of(reg_a), _offset_of(reg_b)) == (1.0, 2.0)
    (a / "helpers.py").write_text("OFFSET = 10")
    assert _offset_of(import_hooks(a, _manifest("a"), 1)) == 10.0   # same version: still fresh
    assert _offset_of(reg_a) == 1.0                                  # the old version keeps its code
    assert not (a / "__pycache__").exists()


def test_import_hooks_errors_name_the_bundle(tmp_path):
    other = _bundle(tmp_path, "c", "from xlaserve import register_model\nregister_model('d', postprocess=len)\n")
    with pytest.raises(BundleError, match=r"bundle 'c': model.py registers \['d'\]"):
        import_hooks(other, _manifest("c"), 1)
    syntax = _bundle(tmp_path, "e", "def broken(:\n")
    with pytest.raises(BundleError, match=r"bundle 'e': model.py line 1"):
        import_hooks(syntax, _manifest("e"), 1)
    meta = parse_manifest({"format_version": "2.0", "kind": "meta",
                           "client_inputs": [{"name": "x", "dtype": "f32", "shape": "n"}],
                           "client_outputs": [{"name": "y", "dtype": "f32", "shape": "n"}]}, "f")
    no_run = _bundle(tmp_path, "f", "from xlaserve import register_model\nregister_model('f', postprocess=len)\n")
    with pytest.raises(BundleError, match=r"kind: meta needs register_model\('f', run=...\)"):
        import_hooks(no_run, meta, 1)


@pytest.mark.parametrize("source, message", [
    ("import sys\nsys.exit(3)\n", "model.py raised SystemExit: 3"),
    ("raise KeyboardInterrupt('stop')\n", "model.py raised KeyboardInterrupt: stop"),
    ("class Stop(BaseException): pass\nraise Stop('now')\n", "model.py raised Stop: now"),
    ("class Odd(Exception):\n    def __str__(self): raise RuntimeError\nraise Odd()\n",
     "model.py raised Odd: <Odd whose str() raised>"),
    ("x = " + "-" * 100_000 + "1\n", "model.py cannot be compiled (MemoryError): it nests expressions too deeply"),
    ("x = 1" + "+1" * 1_000_000 + "\n", "model.py cannot be compiled (RecursionError): it nests expressions too deeply"),
    ("x = 1\0\n", "model.py: source code string cannot contain null bytes"),
], ids=["sys.exit", "KeyboardInterrupt", "BaseException", "str-raises", "deep-unary", "deep-sum", "NUL"])
def test_whatever_model_py_raises_fails_the_load_only(tmp_path, source, message):
    """Escaping import_hooks, these ended the lifecycle actor and with it the worker (sys.exit in
    a bundle's model.py stopped the server)."""
    bundle = _bundle(tmp_path, "g", "")
    (bundle / "model.py").write_text(source)
    with pytest.raises(BundleError) as info:
        import_hooks(bundle, _manifest("g"), 1)
    assert str(info.value).startswith(f"bundle 'g': {message}")


# ---- the CORAL postprocess of severity_grader -------------------------------------------
@pytest.fixture(scope="module")
def grader_postprocess(tmp_path_factory):
    path = tmp_path_factory.mktemp("hooks") / "severity_grader"
    path.mkdir()
    shutil.copy(HOOKS / "severity_grader.py", path / "model.py")
    manifest = _manifest("severity_grader")
    return import_hooks(path, manifest, 1).postprocess


def test_coral_grade_counts_leading_positive_logits_and_stops_at_the_first_other(grader_postprocess):
    logits = np.array([
        [1, 1, -1, 1, 1, 1, 1, 1, 1],      # stops at the third: 2, not 8
        [1] * 9,                           # every threshold passed: 9
        [-1, 1, 1, 1, 1, 1, 1, 1, 1],      # first is not positive: 0
        [1, 1, 1, 0, 1, 1, 1, 1, 1],       # zero is not positive: 3
    ], dtype=np.float32)
    grade, label = grader_postprocess([NamedTensor("OUTPUT__0", logits)])
    assert (grade.name, label.name) == ("grade", "label")
    np.testing.assert_array_equal(grade.data, [[2], [9], [0], [3]])
    assert grade.data.dtype == np.int64 and grade.data.shape == (4, 1)
    assert list(label.data[:, 0]) == [b"minimal", b"critical", b"none", b"mild"]
    random = np.random.default_rng(0).standard_normal((64, 9)).astype(np.float32) + 0.8
    (grade, _) = grader_postprocess([NamedTensor("OUTPUT__0", random)])
    np.testing.assert_array_equal(grade.data, reference.coral_grade_ref(random))


# ---- meta models against a stand-in scheduler ---------------------------------------------
def _version(manifest, hooks=None) -> ModelVersion:
    return ModelVersion(manifest.bundle, 1, Path("/nonexistent"), manifest, "f", None, 0, MappingProxyType({}),
                        hooks, 0.0)


def _meta(run):
    from xlaserve._hooks import Registration
    manifest = parse_manifest({"format_version": "2.0", "kind": "meta",
                               "client_inputs": [{"name": "x", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}],
                               "client_outputs": [{"name": "y", "dtype": "f32", "shape": "fn", "dims": {"f": 4}}]},
                              "meta")
    return _version(manifest, Registration("meta", run=run))


async def _serve_meta(meta: ModelVersion, requests: int, timeout: float | None, after=None, failures=None):
    """Submit ``requests`` meta requests; a stand-in scheduler doubles every sub-call's x. Once
    all are answered, ``after()`` (blocking, in a thread) before the service stops; ``failures``
    (a list) gets each ``(model, hook)`` the service counts as failed."""
    table = ModelTable()
    sub = _version(_manifest("double"))
    table.publish(ModelEntry("double", ModelState.READY, serving=sub))
    table.publish(ModelEntry("meta", ModelState.READY, serving=meta))
    seen: list[InferRequest] = []
    outcomes: dict[int, object] = {}
    all_replied = trio.Event()
    to_scheduler, inbox = trio.open_memory_channel(100)

    def reply(i, outcome):
        outcomes[i] = outcome
        if len(outcomes) == requests:
            all_replied.set()

    async def scheduler():
        async for request in inbox:
            seen.append(request)
            request.reply(InferResult({"y": request.inputs["x"] * 2}, 4, 0, 0, 0, 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler)
        service = InferenceService(to_scheduler, nursery, table,
                                   hook_failed=None if failures is None else lambda *key: failures.append(key))
        for i in range(requests):
            x = np.full((1, 4), i, np.float32)
            service.submit(ClientRequest(meta, {"x": x}, 1, f"r{i}", timeout, functools.partial(reply, i),
                                         time.perf_counter_ns()))
        await all_replied.wait()
        if after is not None:
            await trio.to_thread.run_sync(after)
        nursery.cancel_scope.cancel()
    return seen, outcomes


def test_meta_sub_calls_enter_the_scheduler_with_the_meta_deadline_many_at_once():
    started = []

    def run(tensors, ctx):
        started.append(ctx.request_id)
        once = ctx.infer("double", [NamedTensor("x", tensors[0].data)])["y"]
        return [NamedTensor("y", ctx.infer("double", {"x": once})["y"])]

    seen, outcomes = trio.run(_serve_meta, _meta(run), 8, 30.0)
    assert len(seen) == 16 and sorted(started) == [f"r{i}" for i in range(8)]
    assert all(0 < r.deadline - r.enqueued_at <= 30.0 for r in seen)
    assert {r.request_id.split("/")[1] for r in seen} == {"double#1", "double#2"}
    for i, outcome in outcomes.items():
        assert isinstance(outcome, InferResult)
        np.testing.assert_array_equal(outcome.outputs["y"], np.full((1, 4), 4 * i, np.float32))


def test_meta_errors_name_the_model_hook_and_keep_sub_call_status():
    def bad_input(tensors, ctx):
        return [NamedTensor("y", ctx.infer("double", {"x": np.zeros((1, 4), np.float64)})["y"])]

    def unknown(tensors, ctx):
        return ctx.infer("nope", tensors)

    def raises(tensors, ctx):
        raise KeyError("k")

    def wrong_output(tensors, ctx):
        return [NamedTensor("z", tensors[0].data)]

    (out,) = trio.run(_serve_meta, _meta(bad_input), 1, None)[1].values()
    assert isinstance(out, XlaserveError) and out.status.name == "INTERNAL"
    assert "model 'meta': run: ctx.infer('double') inputs (checked against 'double' client_inputs): tensor 'x': " \
           "expected dtype FP32" in str(out)
    (out,) = trio.run(_serve_meta, _meta(unknown), 1, None)[1].values()
    assert isinstance(out, XlaserveError) and out.status.name == "NOT_FOUND"
    assert str(out).startswith("model 'meta': run: ctx.infer('nope'): Request for unknown model: 'nope' is not "
                               "found; model 'nope' is not in the repository")
    (out,) = trio.run(_serve_meta, _meta(raises), 1, None)[1].values()
    assert isinstance(out, InternalError) and str(out) == "model 'meta': run hook raised KeyError: 'k'"
    (out,) = trio.run(_serve_meta, _meta(wrong_output), 1, None)[1].values()
    assert isinstance(out, XlaserveError) and "run hook output (checked against client_outputs): unexpected " \
                                              "tensor(s) 'z'" in str(out)


def test_a_meta_request_is_answered_at_its_deadline_and_a_later_sub_call_fails_at_once():
    answered, finished = threading.Event(), threading.Event()
    late: list = []

    def run(tensors, ctx):
        answered.wait(5)        # run is still going when the deadline answers its request
        try:
            ctx.infer("double", tensors)
        except SubCallError as exc:
            late.append(exc)
        finished.set()
        return tensors          # dropped: the request was answered

    def release():
        answered.set()
        assert finished.wait(5)

    seen, outcomes = trio.run(functools.partial(_serve_meta, _meta(run), 1, 0.01, after=release),
                              clock=trio.testing.MockClock(autojump_threshold=0))
    (out,) = outcomes.values()
    assert out.status.name == "DEADLINE_EXCEEDED"
    assert str(out) == "model 'meta': request 'r0': the deadline passed before its run hook returned; what it " \
                       "returns is dropped"
    (sub,) = late
    assert not seen and sub.status.name == "DEADLINE_EXCEEDED" and "ctx.infer('double')" in str(sub)


def test_ctx_infer_after_the_request_is_answered_fails_at_once_and_reaches_no_model():
    """A thread that run starts and leaves running (or a ctx kept in a global) is no request any
    more: before, its sub-calls were served for as long as it made them, with no deadline,
    meta-pool slot or client to bound or cancel them."""
    kept: list = []
    late: list = []

    def run(tensors, ctx):
        kept.append(ctx)
        return [NamedTensor("y", ctx.infer("double", tensors)["y"])]

    def after():
        (ctx,) = kept
        for _ in range(3):
            try:
                ctx.infer("double", {"x": np.ones((1, 4), np.float32)})
            except SubCallError as exc:
                late.append(exc)

    seen, outcomes = trio.run(functools.partial(_serve_meta, _meta(run), 1, None, after=after))
    (out,) = outcomes.values()
    assert isinstance(out, InferResult)
    assert len(seen) == 1               # the sub-call run made; none after its answer
    assert [e.status.name for e in late] == ["FAILED_PRECONDITION"] * 3
    assert str(late[0]) == ("model 'meta': run: ctx.infer('double'): model 'meta': request 'r0' has been answered; "
                            "ctx.infer works only until its run returns (join the threads run starts before "
                            "returning)")


def test_a_sub_call_still_queued_when_run_returns_leaves_its_queue():
    """run returns while a thread it started waits on a sub-call: the sub-call is withdrawn
    (answered by the scheduler), so no work of an answered request is left to run."""
    in_queue, done = threading.Event(), threading.Event()
    late: list = []

    def run(tensors, ctx):
        def orphan():
            try:
                ctx.infer("double", tensors)
            except SubCallError as exc:
                late.append(exc.status.name)
            except BaseException as exc:    # what a sub-call left in its queue meets as the service stops
                late.append(type(exc).__name__)
            done.set()
        threading.Thread(target=orphan).start()
        assert in_queue.wait(5)
        return [NamedTensor("y", tensors[0].data)]

    async def main():
        table = ModelTable()
        table.publish(ModelEntry("double", ModelState.READY, serving=_version(_manifest("double"))))
        to_scheduler, inbox = trio.open_memory_channel(100)
        seen: list = []
        outcomes: list = []
        async with trio.open_nursery() as nursery:
            service = InferenceService(to_scheduler, nursery, table)

            async def scheduler():          # holds each request until a CancelRequest names it
                queued = {}
                async for message in inbox:
                    seen.append(message)
                    if isinstance(message, CancelRequest):
                        queued.pop(message.ticket).reply(Cancelled("cancelled in the queue"))
                    else:
                        queued[message.ticket] = message
                        in_queue.set()
            nursery.start_soon(scheduler)
            service.submit(ClientRequest(_meta(run), {"x": np.ones((1, 4), np.float32)}, 1, "r", None,
                                         outcomes.append, time.perf_counter_ns(), "ticket"))
            await trio.to_thread.run_sync(lambda: done.wait(5))
            nursery.cancel_scope.cancel()
        return seen, outcomes

    seen, outcomes = trio.run(main)
    sub, cancel = seen
    assert isinstance(sub, InferRequest) and cancel == CancelRequest(sub.ticket)
    assert late == ["CANCELLED"] and isinstance(outcomes[0], InferResult)


# ---- cancellation stops a hooks or meta request at its next stage boundary ----------------
async def _serve_cancelled(model: ModelVersion, *, cancel_on_enqueue: bool, before_cancel=None,
                           after_cancel=None):
    """Submit one request of ``model`` under a ticket and cancel it: when its first request
    reaches the stand-in scheduler (``cancel_on_enqueue``), else once ``before_cancel`` (a
    blocking callable, run in a thread) returns; then ``after_cancel()``. The stand-in holds requests until a CancelRequest names them
    (answered CANCELLED, as the scheduler does) or, if the request was cancelled on arrival,
    answers it as executed. Returns the scheduler's messages, the one outcome, the service."""
    table = ModelTable()
    table.publish(ModelEntry("double", ModelState.READY, serving=_version(_manifest("double"))))
    seen: list = []
    outcomes: list = []
    replied = trio.Event()
    to_scheduler, inbox = trio.open_memory_channel(100)
    queued: dict = {}

    async def scheduler():
        async for message in inbox:
            seen.append(message)
            if isinstance(message, CancelRequest):
                request = queued.pop(message.ticket, None)
                if request is not None:
                    request.reply(Cancelled("cancelled in the queue"))
            elif cancel_on_enqueue and model.is_meta:
                queued[message.ticket] = message
                service.cancel("ticket")
            elif cancel_on_enqueue:              # the client goes away while it executes
                service.cancel("ticket")
                message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))
            else:
                message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))

    def reply(outcome):
        outcomes.append(outcome)
        replied.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler)
        service = InferenceService(to_scheduler, nursery, table)
        service.submit(ClientRequest(model, {"x": np.ones((1, 4), np.float32)}, 1, "r", None, reply,
                                     time.perf_counter_ns(), "ticket"))
        if before_cancel is not None:
            await trio.to_thread.run_sync(before_cancel)
            service.cancel("ticket")
            after_cancel()
        with trio.move_on_after(5):     # a request that is never answered fails the test, not hangs it
            await replied.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return seen, outcomes, service


def test_a_meta_request_cancelled_takes_back_its_queued_sub_call_and_makes_no_more():
    calls = []

    def run(tensors, ctx):
        for _ in range(2):
            try:
                ctx.infer("double", tensors)
            except SubCallError as exc:
                calls.append(exc.status.name)
        return [NamedTensor("y", tensors[0].data)]

    seen, outcomes, service = trio.run(functools.partial(_serve_cancelled, _meta(run), cancel_on_enqueue=True))
    sub, cancel = seen
    assert isinstance(sub, InferRequest) and cancel == CancelRequest(sub.ticket)
    assert calls == ["CANCELLED", "CANCELLED"]      # the second sub-call never reached the scheduler
    (outcome,) = outcomes
    assert isinstance(outcome, Cancelled) and "model 'meta': the client cancelled request 'r'" in str(outcome)
    assert service._tasks == {}


def _hooked(preprocess=None, postprocess=None) -> ModelVersion:
    from xlaserve._hooks import Registration
    return _version(_manifest("h"), Registration("h", preprocess=preprocess, postprocess=postprocess))


@pytest.mark.parametrize("with_preprocess", [True, False], ids=["pre+post (a task)", "post only (task-free)"])
def test_a_request_cancelled_while_it_executes_skips_its_postprocess(with_preprocess):
    ran = []

    def post(tensors):
        ran.append("post")
        return tensors

    model = _hooked(preprocess=(lambda tensors: tensors) if with_preprocess else None, postprocess=post)
    seen, outcomes, service = trio.run(functools.partial(_serve_cancelled, model, cancel_on_enqueue=True))
    assert [type(m) for m in seen] == [InferRequest, CancelRequest]
    (outcome,) = outcomes
    assert isinstance(outcome, Cancelled) and ran == []
    assert service._tasks == {}


def test_a_request_cancelled_during_its_preprocess_is_never_queued():
    entered, go = threading.Event(), threading.Event()

    def pre(tensors):
        entered.set()
        go.wait(5)
        return tensors

    def in_preprocess():
        assert entered.wait(5)

    seen, outcomes, service = trio.run(functools.partial(
        _serve_cancelled, _hooked(preprocess=pre, postprocess=None), cancel_on_enqueue=False,
        before_cancel=in_preprocess, after_cancel=go.set))
    (outcome,) = outcomes
    assert seen == [] and isinstance(outcome, Cancelled)
    assert service._tasks == {}


# ---- user code may raise or return anything: its request only fails, once, counted -------
class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


class _BadEq(str):
    def __hash__(self):
        raise ValueError("no hash")


def _gen(tensors):
    yield from tensors


@pytest.mark.parametrize("returned, message", [
    ([NamedTensor(["grade"], np.zeros((3, 1), np.int64))], "a tensor's name must be a str, found list ['grade']"),
    ({1: np.zeros((3, 1), np.int64)}, "a tensor's name must be a str, found int 1"),
    (None, "expected a list of NamedTensor, found NoneType"),
    (_gen([]), "expected a list of NamedTensor, found generator"),
    ([NamedTensor(_BadEq("grade"), np.zeros((3, 1), np.int64))],
     "could not be checked (ValueError: no hash); expected a list of NamedTensor(name: str, data: numpy.ndarray)"),
])
def test_conform_raises_internal_error_only_whatever_it_is_given(returned, message):
    with pytest.raises(InternalError) as info:
        conform(returned, GRADE_OUT.client_outputs, where="model 'g': postprocess hook output", rows=3)
    assert str(info.value).startswith("model 'g': postprocess hook output: ") and message in str(info.value)


@pytest.mark.parametrize("exc, message", [
    (SystemExit(3), "SystemExit: 3"), (KeyboardInterrupt(), "KeyboardInterrupt: "),
    (_Unprintable(), "_Unprintable: <_Unprintable whose str() raised>"),
    (ValueError("x" * 5000), "ValueError: " + "x" * 200 + "... (4800 more characters)"),
])
def test_call_hook_turns_anything_raised_into_internal_error_and_counts_it(exc, message):
    counted = []

    def hook(tensors):
        raise exc
    with pytest.raises(InternalError) as info:
        call_hook(SimpleNamespace(name="g"), "preprocess", hook, {}, GRADE_OUT.client_outputs, 1,
                  lambda *key: counted.append(key))
    assert str(info.value) == f"model 'g': preprocess hook raised {message}"
    assert counted == [("g", "preprocess")]
    with pytest.raises(InternalError, match="postprocess hook output .*a tensor's name must be a str"):
        call_hook(SimpleNamespace(name="g"), "postprocess", lambda t: [NamedTensor(["y"], np.zeros(1))], {},
                  GRADE_OUT.client_outputs, 1, lambda *key: counted.append(key))
    assert counted == [("g", "preprocess"), ("g", "postprocess")]


async def _submit_behind_a_hung_one(service, model: ModelVersion, requests: int, replies: list,
                                    hung: threading.Event) -> None:
    """Submit ``requests`` to ``model``: the first (x = -1, no deadline) hangs its hook, and the
    rest (x = 1, a 5 s deadline) go in once it has started (``hung`` set)."""
    for i in range(requests):
        service.submit(ClientRequest(model, {"x": np.full((1, 4), -1 if i == 0 else 1, np.float32)}, 1,
                                     f"r{i}", None if i == 0 else 5.0, replies.append, time.perf_counter_ns()))
        if i == 0:
            await trio.to_thread.run_sync(hung.wait, 10)


async def _serve_hooked(model: ModelVersion, requests: int, timeout: float | None = None, release=None):
    """Submit ``requests`` requests of ``model`` to a service over a stand-in scheduler that
    doubles x. Waits for each to be answered, then ``release()`` (blocking, in a thread: lets
    hooks still running finish) and until the service's tasks are idle. Returns every reply call
    per request (exactly one each, or the test fails) and the failures counted."""
    replies: dict[int, list] = {i: [] for i in range(requests)}
    failures: list = []
    all_replied = trio.Event()
    to_scheduler, inbox = trio.open_memory_channel(100)

    token = trio.lowlevel.current_trio_token()

    def record(i, outcome):
        replies[i].append(outcome)
        if all(replies.values()):
            all_replied.set()

    def reply(i, outcome):                  # from the Trio thread or a hook thread, as the frontend's
        token.run_sync_soon(record, i, outcome)

    async def scheduler():
        async for message in inbox:
            message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler)
        service = InferenceService(to_scheduler, nursery, ModelTable(), hook_threads=2,
                                   hook_failed=lambda *key: failures.append(key))
        for i in range(requests):
            service.submit(ClientRequest(model, {"x": np.full((1, 4), i, np.float32)}, 1, f"r{i}", timeout,
                                         functools.partial(reply, i), time.perf_counter_ns()))
        with trio.move_on_after(30):        # a request never answered fails the test, not hangs it
            await all_replied.wait()
        if release is not None:
            await trio.to_thread.run_sync(release)
        await trio.sleep(0.05)              # a late result, if it were not dropped, would arrive here
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return replies, failures


WRONG_RETURNS = {
    "name is a list": lambda t: [NamedTensor([t[0].name], t[0].data)],
    "None": lambda t: None,
    "a generator": lambda t: (x for x in t),
    "not an array": lambda t: [NamedTensor(t[0].name, t[0].data.tolist())],
    "wrong dtype": lambda t: [NamedTensor(t[0].name, t[0].data.astype(np.float64))],
    "raises SystemExit": lambda t: sys.exit(3),
}


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
@pytest.mark.parametrize("kind", list(WRONG_RETURNS))
def test_a_failing_hook_answers_each_of_its_requests_once_and_counts(stage, kind):
    model = _hooked(**{stage: WRONG_RETURNS[kind]})
    replies, failures = trio.run(_serve_hooked, model, 8)
    for calls in replies.values():
        (outcome,) = calls
        assert isinstance(outcome, InternalError) and str(outcome).startswith(f"model 'h': {stage} hook ")
    assert failures == [("h", stage)] * 8


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
def test_a_hook_past_the_deadline_is_answered_then_and_its_late_result_dropped(stage):
    go, ran = threading.Event(), []

    def slow(tensors):
        ran.append(1)
        go.wait(10)
        return tensors

    def release():
        go.set()
        time.sleep(0.1)                     # the hooks return now; their results must go nowhere

    model = _hooked(**{stage: slow})
    # three requests on two hook threads: the third's hook never starts. The clock jumps to the
    # deadline once the Trio side has idled 0.5 s of real time, long after two threads took work.
    replies, failures = trio.run(functools.partial(_serve_hooked, model, 3, 5.0, release),
                                 clock=trio.testing.MockClock(autojump_threshold=0.5))
    messages = []
    for calls in replies.values():
        (outcome,) = calls
        assert isinstance(outcome, DeadlineExceeded), outcome
        messages.append(str(outcome))
    # two hooks ran past the deadline; the third never got a thread, and its answer says so
    assert sum(f"the deadline passed before its {stage} hook returned" in m for m in messages) == 2
    assert sum(f"waited for a thread: all 2 hook threads are busy" in m for m in messages) == 1
    assert len(ran) == 2 and failures == []


def test_a_bug_in_a_request_task_is_internal_for_that_request(monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(InferenceService, "execute", broken)
    replies, _ = trio.run(_serve_hooked, _hooked(preprocess=lambda t: t), 2)
    for calls in replies.values():
        (outcome,) = calls
        assert isinstance(outcome, InternalError) and str(outcome) == \
            "internal error in model 'h': RuntimeError: a bug"


def test_meta_run_raising_anything_or_a_sub_model_hook_failing_is_counted_where_it_failed():
    def exits(tensors, ctx):
        raise SystemExit(1)

    failures: list = []
    (out,) = trio.run(functools.partial(_serve_meta, _meta(exits), 1, None, failures=failures))[1].values()
    assert isinstance(out, InternalError) and str(out) == "model 'meta': run hook raised SystemExit: 1"
    assert failures == [("meta", "run")]

    def bad_name(tensors, ctx):
        return [NamedTensor(["y"], tensors[0].data)]
    failures.clear()
    (out,) = trio.run(functools.partial(_serve_meta, _meta(bad_name), 1, None, failures=failures))[1].values()
    assert isinstance(out, InternalError) and "model 'meta': run hook output (checked against client_outputs): " \
        "a tensor's name must be a str, found list ['y']" in str(out)
    assert failures == [("meta", "run")]


def _hanging(ran: list | None = None):
    """A hook that never returns (until ``release`` is set, 30 s at most) when its first input's
    first value is negative, and returns its tensors otherwise; ``hung`` is set once one hangs.
    ``ran`` (optional) hears "hung" or "later" for each call."""
    hung, release = threading.Event(), threading.Event()

    def hook(tensors):
        negative = tensors[0].data.flat[0] < 0
        if ran is not None:
            ran.append("hung" if negative else "later")
        if negative:
            hung.set()
            release.wait(30)
        return tensors
    return hook, hung, release


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
def test_requests_answered_while_waiting_for_a_hook_thread_leave_the_queue(stage):
    """A hook that never returns holds the pool's one thread; each later request is answered
    DEADLINE_EXCEEDED while it waits for a thread, and its work item leaves the pool's queue
    then, letting go of the request's tensors. It stayed queued for good before: 150 KB a request
    kept by a worker whose 16 hook threads hung (76 MB per 500 requests with 20 ms deadlines)."""
    hook, hung, release = _hanging()
    tensors_made: list[weakref.ref] = []    # what a waiting hook would get: the inputs, or the outputs

    async def main():
        replies: list = []
        to_scheduler, inbox = trio.open_memory_channel(100)

        async def scheduler():
            async for message in inbox:
                y = message.inputs["x"] * 2
                if stage == "postprocess" and y.flat[0] > 0:
                    tensors_made.append(weakref.ref(y))
                message.reply(InferResult({"y": y}, 4, 0, 0, 0, 0))
                del y

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler)
            service = InferenceService(to_scheduler, nursery, ModelTable(), hook_threads=1)
            model = _hooked(**{stage: hook})
            for i in range(21):
                x = np.full((1, 4), -1 if i == 0 else 1, np.float32)
                if stage == "preprocess" and i:
                    tensors_made.append(weakref.ref(x))
                service.submit(ClientRequest(model, {"x": x}, 1, f"r{i}", None if i == 0 else 0.05, replies.append,
                                             time.perf_counter_ns()))
                if i == 0:
                    await trio.to_thread.run_sync(hung.wait, 10)
            del x
            with trio.move_on_after(10):
                while len(replies) < 20:
                    await trio.sleep(0.01)
            gc.collect()
            kept = sum(ref() is not None for ref in tensors_made)
            release.set()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return replies, kept

    replies, kept = trio.run(main)
    assert len(replies) == 21 and all(isinstance(r, DeadlineExceeded) for r in replies[:20]), replies
    # the answer says the hook never ran for want of a thread (it blamed a hook that never started)
    assert sorted(str(r) for r in replies[:20]) == sorted(
        f"model 'h': request 'r{i}': the deadline passed while its {stage} hook waited for a thread: all 1 hook "
        "threads are busy with hooks that have not returned; it never ran" for i in range(1, 21))
    assert len(tensors_made) == 20
    assert kept == 0, f"the tensors of {kept} of 20 requests already answered are still held, waiting for a hook thread"


async def _cancel_behind_a_hung_hook(stage: str, hook, hung: threading.Event, release: threading.Event,
                                     while_hung=None):
    """Two ticketed requests without a deadline to a model whose ``stage`` hook is ``hook`` (from
    :func:`_hanging`), one hook thread: the first hangs it; the second waits for a thread and its
    client goes away (``t1`` cancelled). Then ``while_hung(service, replies)`` (awaited, if
    given), the hook released, both answered. Returns the replies by index, the tickets still
    (ticket -> stages) still known once both are answered, and what ``while_hung`` returned."""
    replies: dict = {}
    to_scheduler, inbox = trio.open_memory_channel(100)

    async def scheduler():
        async for message in inbox:
            if isinstance(message, InferRequest):
                message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))

    seen = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler)
        service = InferenceService(to_scheduler, nursery, ModelTable(), hook_threads=1)
        model = _hooked(**{stage: hook})
        for i, value in enumerate((-1, 1)):
            service.submit(ClientRequest(model, {"x": np.full((1, 4), value, np.float32)}, 1, f"r{i}", None,
                                         lambda out, i=i: replies.__setitem__(i, out), time.perf_counter_ns(),
                                         ticket=f"t{i}"))
            if i == 0:
                await trio.to_thread.run_sync(hung.wait, 10)
        with trio.move_on_after(10):
            while service.thread_statistics().hook.waiting < 1:
                await trio.sleep(0.01)
        service.cancel("t1")                # its client went away
        if while_hung is not None:
            seen = await while_hung(service, replies)
        release.set()
        with trio.move_on_after(10):
            while len(replies) < 2:
                await trio.sleep(0.01)
        tasks = dict(service._tasks)
        nursery.cancel_scope.cancel()
    return replies, tasks, seen


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
def test_a_request_cancelled_while_its_hook_waits_for_a_thread_is_answered_without_running_it(stage):
    """The client of a hooked request goes away while its hook waits for a thread (all of them
    held). Its hook ran later all the same, holding a thread for nobody (a postprocess-only
    request was not even cancellable then: its ticket was dropped when the execution answered).
    Now it is answered CANCELLED when its turn comes, its hook not run, its ticket forgotten."""
    ran: list[str] = []
    hook, hung, release = _hanging(ran)
    replies, tasks, _ = trio.run(_cancel_behind_a_hung_hook, stage, hook, hung, release)
    assert ran == ["hung"], ran                 # the cancelled request's hook never ran
    assert isinstance(replies[1], Cancelled) and "r1" in str(replies[1]), replies[1]
    assert isinstance(replies[0], InferResult)
    assert tasks == {}                          # both tickets forgotten once answered


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
def test_a_request_cancelled_while_every_hook_thread_hangs_is_answered_at_once(stage):
    """As above, but the hook threads stay held: the cancelled request (no deadline) is answered
    CANCELLED at once, its work taken out of the pool's queue, not when a thread frees (it held
    its admission slot, its tensors and its ticket for as long as the hooks hung)."""
    hook, hung, release = _hanging()

    async def while_hung(service, replies):     # the hung hook holds on: answered all the same
        with trio.move_on_after(10):
            while 1 not in replies:
                await trio.sleep(0.01)
        return service.thread_statistics().hook.waiting, set(service._tasks)

    replies, _, (waiting, tasks) = trio.run(_cancel_behind_a_hung_hook, stage, hook, hung, release, while_hung)
    assert isinstance(replies[1], Cancelled) and "r1" in str(replies[1]), replies[1]
    assert waiting == 0                         # out of the pool's queue while the hook still hung
    assert tasks == {"t0"}                      # its ticket forgotten; the hung one's kept
    assert isinstance(replies[0], InferResult)


def test_the_deadline_watcher_keeps_no_finished_postprocess_alive():
    """The watcher of postprocess deadlines holds each request's work item weakly: once a hook
    thread has run it, what it held (the execution's outputs) goes with it, not when its
    deadline comes up (a minute later, say, with thousands of requests in between)."""
    import gc
    import weakref

    from xlaserve.worker.inference import HookPool, _Answer, _Expiry
    pool = HookPool(1)
    expiry = _Expiry(pool, lambda *key: None)
    outputs = np.zeros(1000, np.float32)
    kept = weakref.ref(outputs)
    ran = threading.Event()

    def work(held=outputs) -> None:
        ran.set()
    answer = _Answer(lambda outcome: None)
    expiry.add(1e9, answer, "m", "r1", work)
    pool.submit(work)
    assert ran.wait(5)
    answer(None)                    # the hook's result answered it
    del work, outputs
    for _ in range(50):             # the pool's thread lets its work item go right after running it
        gc.collect()
        if kept() is None:
            break
        time.sleep(0.01)
    assert kept() is None, "the deadline watcher kept the outputs of a postprocess that had run"


# ---- hook threads: how busy, and who never got one ------------------------------------------
def _until(condition, seconds: float = 10.0) -> None:
    """Wait (blocking) for ``condition()``: a hook thread's bookkeeping after a hook returns."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_the_hook_pool_counts_busy_threads_and_waiting_work_on_every_path():
    """What ``xlaserve_hook_threads_busy`` and ``xlaserve_hook_requests_waiting`` read: a hung
    hook stays busy, work that returns or raises (SystemExit too) is busy only while it runs,
    withdrawn work stops waiting."""
    from xlaserve.worker.inference import HookPool, ThreadPoolStatistics
    pool = HookPool(2)
    assert pool.statistics() == ThreadPoolStatistics(size=2, busy=0, waiting=0)
    started, release = threading.Semaphore(0), threading.Event()

    def hangs():
        started.release()
        release.wait(30)

    def raises():
        raise SystemExit(3)
    ran = []
    pool.submit(hangs)
    pool.submit(hangs)
    assert started.acquire(timeout=10) and started.acquire(timeout=10)
    assert pool.statistics() == ThreadPoolStatistics(2, 2, 0)
    withdrawn = functools.partial(ran.append, "withdrawn")
    for work in (withdrawn, raises, functools.partial(ran.append, "returned")):
        pool.submit(work)
    assert pool.statistics() == ThreadPoolStatistics(2, 2, 3)
    assert pool.withdraw(withdrawn) and not pool.withdraw(withdrawn)
    assert pool.statistics() == ThreadPoolStatistics(2, 2, 2)
    release.set()
    _until(lambda: pool.statistics() == ThreadPoolStatistics(2, 0, 0))
    assert ran == ["returned"]


@pytest.mark.parametrize("stage", ["preprocess", "postprocess"])
def test_requests_starved_of_a_hook_thread_are_counted_and_the_pool_shows_busy(stage):
    """One hook that never returns holds the only hook thread: the status and /metrics show it
    busy and three requests waiting; at their deadline each is answered, counted under its model
    and hook in ``hook_starved``, and leaves the queue. When the hook returns the thread is free."""
    from xlaserve.worker.inference import HookThreads, ThreadPoolStatistics
    hook, hung, release = _hanging()

    async def main():
        replies: list = []
        starved: list = []
        seen: list[HookThreads] = []
        to_scheduler, inbox = trio.open_memory_channel(100)

        async def scheduler():
            async for message in inbox:
                message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler)
            service = InferenceService(to_scheduler, nursery, ModelTable(), hook_threads=1, meta_threads=3,
                                       hook_starved=lambda *key: starved.append(key))
            seen.append(service.thread_statistics())
            await _submit_behind_a_hung_one(service, _hooked(**{stage: hook}), 4, replies, hung)
            await trio.sleep(1)                 # (mock time, short of the deadline)
            seen.append(service.thread_statistics())
            await trio.sleep(5)                 # past it
            seen.append(service.thread_statistics())
            release.set()
            while len(replies) < 4:             # the hung request, served once its hook returns
                await trio.sleep(0.01)
            await trio.to_thread.run_sync(_until, lambda: service.thread_statistics().hook.busy == 0)
            seen.append(service.thread_statistics())
            nursery.cancel_scope.cancel()
        return replies, starved, seen

    replies, starved, seen = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.5))
    meta = ThreadPoolStatistics(3, 0, 0)
    assert seen == [HookThreads(ThreadPoolStatistics(1, 0, 0), meta), HookThreads(ThreadPoolStatistics(1, 1, 3), meta),
                    HookThreads(ThreadPoolStatistics(1, 1, 0), meta), HookThreads(ThreadPoolStatistics(1, 0, 0), meta)]
    assert starved == [("h", stage)] * 3
    assert len(replies) == 4 and all("waited for a thread: all 1 hook threads are busy" in str(r)
                                     for r in replies[:3]), replies


def test_a_request_waiting_for_a_hook_thread_when_the_worker_stops_leaves_the_queue():
    """The worker stops (its nursery is cancelled) while a request's preprocess waits for the
    only hook thread, held by a hook that never returns: the request is answered UNAVAILABLE
    and its work leaves the queue then (it stayed there, counted as waiting, before)."""
    from xlaserve.errors import Unavailable
    hook, hung, release = _hanging()

    async def main():
        replies: list = []
        starved: list = []
        to_scheduler, _ = trio.open_memory_channel(100)
        async with trio.open_nursery() as nursery:
            service = InferenceService(to_scheduler, nursery, ModelTable(), hook_threads=1,
                                       hook_starved=lambda *key: starved.append(key))
            model = _hooked(preprocess=hook)
            for i in range(2):
                service.submit(ClientRequest(model, {"x": np.full((1, 4), -1 if i == 0 else 1, np.float32)}, 1,
                                             f"r{i}", None, replies.append, time.perf_counter_ns()))
                if i == 0:
                    await trio.to_thread.run_sync(hung.wait, 10)
            await trio.testing.wait_all_tasks_blocked()
            assert service.thread_statistics().hook.waiting == 1
            nursery.cancel_scope.cancel()
        stats = service.thread_statistics().hook
        release.set()
        return replies, starved, stats

    replies, starved, stats = trio.run(main)
    assert len(replies) == 2 and all(isinstance(r, Unavailable) for r in replies)
    assert (stats.busy, stats.waiting) == (1, 0)
    assert starved == [("h", "preprocess")]


def test_a_meta_request_that_never_got_a_meta_thread_is_told_so_and_counted():
    """Every meta thread is held by a ``run`` that never returns: a meta request with a deadline
    is answered then with what happened (it never ran, all N meta threads are busy), counted in
    ``hook_starved`` as ``run``; the meta pool shows it busy and waiting. (It was answered as if
    its run had started and run late.)"""
    from xlaserve.worker.inference import ThreadPoolStatistics
    hook, hung, release = _hanging()

    def run(tensors, ctx):
        return hook(tensors)

    async def main():
        replies: list = []
        starved: list = []
        seen: list = []
        to_scheduler, _ = trio.open_memory_channel(100)
        table = ModelTable()
        meta = _meta(run)
        table.publish(ModelEntry("meta", ModelState.READY, serving=meta))
        async with trio.open_nursery() as nursery:
            service = InferenceService(to_scheduler, nursery, table, meta_threads=1,
                                       hook_starved=lambda *key: starved.append(key))
            await _submit_behind_a_hung_one(service, meta, 2, replies, hung)
            await trio.sleep(1)
            seen.append(service.thread_statistics().meta)
            await trio.sleep(5)
            seen.append(service.thread_statistics().meta)
            release.set()
            while len(replies) < 2 or service.thread_statistics().meta.busy:
                await trio.sleep(0.01)
            seen.append(service.thread_statistics().meta)
            nursery.cancel_scope.cancel()
        return replies, starved, seen

    replies, starved, seen = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.5))
    assert seen == [ThreadPoolStatistics(1, 1, 1), ThreadPoolStatistics(1, 1, 0), ThreadPoolStatistics(1, 0, 0)]
    late = replies[0]
    assert isinstance(late, DeadlineExceeded) and str(late) == (
        "model 'meta': request 'r1': the deadline passed while its run hook waited for a thread: all 1 meta threads "
        "are busy with hooks that have not returned; it never ran")
    assert starved == [("meta", "run")]


# ---- what hooks return, against the limit on the reply --------------------------------------
@pytest.mark.parametrize("array, dtype", [
    (np.zeros((3, 5), np.float32), "FP32"), (np.zeros((0, 4), np.int64), "INT64"), (np.ones(7, bool), "BOOL"),
    (np.array([[b"ab", b""], [b"xyz", b"\x00q"]], dtype=object), "BYTES"),
    (np.array([b"ab", b"", b"xyz\x00"], dtype="S5"), "BYTES"), (np.array([], dtype=object), "BYTES"),
], ids=["fp32", "empty", "bool", "bytes-object", "bytes-S", "bytes-empty"])
def test_encoded_size_is_the_length_of_the_encoded_output_without_encoding(array, dtype):
    from xlaserve.codec import encode_output, encoded_size
    from xlaserve.dtypes import BY_KSERVE
    assert encoded_size(array, BY_KSERVE[dtype]) == len(encode_output(array, BY_KSERVE[dtype]))


def test_check_reply_size_counts_the_outputs_the_reply_carries_and_names_hook_size_and_limit():
    from xlaserve.errors import ResourceExhausted
    from xlaserve.worker.inference import ReplyLimit, check_reply_size
    decls = GRADE_OUT.client_outputs
    outputs = {"grade": np.zeros((2, 1), np.int64), "label": np.array([[b"abc"], [b""]], dtype=object)}
    # grade: 16 bytes; label: 4 + 3 + 4 + 0 = 11 bytes
    check_reply_size(outputs, decls, None, model="g", hook="postprocess")
    check_reply_size(outputs, decls, ReplyLimit(27), model="g", hook="postprocess")
    check_reply_size(outputs, decls, ReplyLimit(16, frozenset({"grade"})), model="g", hook="postprocess")
    check_reply_size(outputs, decls, ReplyLimit(0, frozenset()), model="g", hook="postprocess")
    with pytest.raises(ResourceExhausted) as info:
        check_reply_size(outputs, decls, ReplyLimit(26), model="g", hook="postprocess")
    assert str(info.value) == (
        "model 'g': the outputs its postprocess hook returned are 27 bytes in the response (tensor 'grade': 16 "
        "bytes), the limit (endpoints.max_send_msg_bytes) is 26; ask for the outputs in shared memory or raise the "
        "limit")
    with pytest.raises(ResourceExhausted, match="outputs its run hook returned are 11 bytes .*'label'"):
        check_reply_size(outputs, decls, ReplyLimit(10, frozenset({"label"})), model="g", hook="run")


@pytest.mark.parametrize("kind", ["post only (task-free)", "pre+post (a task)", "meta run"])
def test_hook_outputs_past_the_reply_limit_are_refused_in_the_hook_thread(kind):
    """A postprocess (or meta run) whose outputs the reply could not carry fails its request
    RESOURCE_EXHAUSTED naming the hook, the size and the limit, decided in the hook's thread;
    outputs that fit are served. The frontend found out only after encoding the reply on the
    Trio thread."""
    from xlaserve.errors import ResourceExhausted
    from xlaserve.worker.inference import ReplyLimit
    on_trio = []

    def post(tensors):
        on_trio.append(threading.current_thread() is threading.main_thread())
        return tensors

    if kind == "meta run":
        model = _meta(lambda tensors, ctx: post([NamedTensor("y", tensors[0].data * 2)]))
        hook = "run"
    else:
        model = _hooked(preprocess=(lambda t: t) if kind.startswith("pre") else None, postprocess=post)
        hook = "postprocess"

    async def main():
        replies: dict = {}
        all_replied = trio.Event()
        to_scheduler, inbox = trio.open_memory_channel(100)
        table = ModelTable()
        table.publish(ModelEntry(model.name, ModelState.READY, serving=model))
        token = trio.lowlevel.current_trio_token()

        async def scheduler():
            async for message in inbox:
                message.reply(InferResult({"y": message.inputs["x"] * 2}, 4, 0, 0, 0, 0))

        def record(limit, outcome):
            replies[limit] = outcome
            if len(replies) == 2:
                all_replied.set()

        def reply(limit, outcome):          # from a hook thread, as the frontend's
            token.run_sync_soon(record, limit, outcome)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler)
            service = InferenceService(to_scheduler, nursery, table)
            for limit in (15, 16):      # y is FP32 [1,4]: 16 bytes
                service.submit(ClientRequest(model, {"x": np.ones((1, 4), np.float32)}, 1, f"r{limit}", None,
                                             functools.partial(reply, limit), time.perf_counter_ns(),
                                             reply_limit=ReplyLimit(limit)))
            await all_replied.wait()
            nursery.cancel_scope.cancel()
        return replies

    replies = trio.run(main)
    refused, served = replies[15], replies[16]
    assert isinstance(refused, ResourceExhausted) and str(refused) == (
        f"model '{model.name}': the outputs its {hook} hook returned are 16 bytes in the response (tensor 'y': 16 "
        "bytes), the limit (endpoints.max_send_msg_bytes) is 15; ask for the outputs in shared memory or raise the "
        "limit")
    assert isinstance(served, InferResult) and served.outputs["y"].nbytes == 16
    assert on_trio == [False, False]
