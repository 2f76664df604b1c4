"""The frontend's admission bookkeeping (xlaserve/frontend/admission.py), without a server."""
from __future__ import annotations

import pytest

from xlaserve.dtypes import BY_CODE
from xlaserve.errors import ResourceExhausted
from xlaserve.frontend.admission import Admission, output_bytes_per_row
from xlaserve.manifest import TensorDecl


def test_uncapped_count_lets_any_number_in():
    a = Admission(0, 10**9)
    for _ in range(10_000):
        a.enter()
    assert a.in_flight == 10_000


def test_count_cap_refuses_past_it_and_counts_the_refused_until_they_leave():
    a = Admission(2, 10**9)
    a.enter()
    a.enter()
    with pytest.raises(ResourceExhausted) as info:
        a.enter()
    assert str(info.value) == ("2 inference requests are in flight, the limit (endpoints.max_concurrent_requests) "
                               "is 2; retry later")
    assert a.in_flight == 3
    a.leave(0)        # the refused one is answered
    a.leave(0)        # so is one of the others: room for one more
    a.enter()
    assert a.in_flight == 2


def test_byte_budget_holds_up_to_the_limit_and_refuses_the_request_that_crosses_it():
    a = Admission(0, 1000)
    for _ in range(3):
        a.enter()
    assert a.hold(600) == 600
    with pytest.raises(ResourceExhausted) as info:
        a.hold(500)
    message = str(info.value)
    assert "would hold 1100 bytes" in message and "(500 bytes)" in message
    assert "(endpoints.max_held_request_bytes) is 1000" in message
    assert a.held_bytes == 600            # the refused request holds nothing
    assert a.hold(400) == 400             # exactly at the limit is allowed
    assert a.held_bytes == 1000
    a.leave(0)                            # the refused one
    a.leave(600)
    a.leave(400)
    assert (a.in_flight, a.held_bytes) == (0, 0)


def test_a_request_larger_than_the_whole_budget_says_so():
    a = Admission(0, 1000)
    a.enter()
    with pytest.raises(ResourceExhausted) as info:
        a.hold(1001)
    assert str(info.value).startswith("this request needs 1001 bytes")
    assert "(endpoints.max_held_request_bytes) of 1000" in str(info.value)
    assert a.held_bytes == 0


def test_output_bytes_per_row_counts_fixed_size_outputs_only():
    outputs = (
        TensorDecl("logits", BY_CODE["f32"], "cn", {"c": 10}),      # batched: 40 bytes a row
        TensorDecl("label", BY_CODE["i64"], "n", {}),               # batched: 8 bytes a row
        TensorDecl("table", BY_CODE["u8"], "ab", {"a": 3, "b": 5}),  # unbatched: 15 bytes
        TensorDecl("text", BY_CODE["bytes"], "n", {}),              # variable: not counted
    )
    assert output_bytes_per_row(outputs) == (48, 15)


def test_an_admitted_request_gives_back_everything_once_whichever_step_it_failed_at():
    """Admitted is what the KServe service answers through: a release after any step returns
    the counts to zero, and a second release (an answer sent twice by a bug) gives nothing back."""
    a = Admission(2, 1000)
    refused = [a.admit() for _ in range(3)]
    with pytest.raises(ResourceExhausted, match="2 inference requests are in flight"):
        refused[2].check()
    refused[0].found("m")
    refused[0].hold(600)
    refused[1].found("m")
    with pytest.raises(ResourceExhausted):
        refused[1].hold(500)          # nothing held: only its count and model to give back
    assert (a.in_flight, a.held_bytes, a.by_model) == (3, 600, {"m": 2})
    assert [r.release() for r in refused] == [True, True, True]
    assert [r.release() for r in refused] == [False, False, False]
    assert (a.in_flight, a.held_bytes, a.by_model) == (0, 0, {})
