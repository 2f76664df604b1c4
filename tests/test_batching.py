"""Batch planning: which queued requests run together and at which compiled size."""
from __future__ import annotations

import pytest

from xlaserve.worker.batching import choose_batch, plan_batch, smallest_holding

SIZES = (1, 2, 4, 8, 16, 32)


def test_smallest_holding():
    assert smallest_holding(SIZES, 1) == 1
    assert smallest_holding(SIZES, 3) == 4
    assert smallest_holding(SIZES, 32) == 32
    assert smallest_holding(SIZES, 33) is None


def test_full_queue_fills_the_largest_size():
    plan = plan_batch([1] * 40, SIZES)
    assert plan.indices == tuple(range(32)) and plan.size == 32 and plan.padding == 0


def test_partial_fill_pads_to_the_smallest_size_that_holds_it():
    plan = plan_batch([1] * 5, SIZES)
    assert plan.rows == 5 and plan.size == 8 and plan.padding == 3
    assert plan_batch([3], SIZES).size == 4
    assert plan_batch([1], SIZES).size == 1


def test_most_rows_beat_less_padding():
    # 20 rows: size 32 serves all 20 (12 padding) rather than size 16 serving 16 exactly
    plan = plan_batch([1] * 20, SIZES)
    assert plan.rows == 20 and plan.size == 32


def test_never_splits_a_request_and_fills_around_a_large_one():
    # 30 rows, then a 5-row request that does not fit, then 2 one-row requests that do
    plan = plan_batch([10, 10, 10, 5, 1, 1], SIZES)
    assert plan.indices == (0, 1, 2, 4, 5) and plan.rows == 32 and plan.size == 32
    # every request taken is whole: the rows add up exactly
    assert plan.rows == sum([10, 10, 10, 1, 1])


def test_cap_limits_rows_and_a_single_larger_request_runs_alone():
    plan = plan_batch([1] * 40, SIZES, cap=6)
    assert plan.rows == 6 and plan.size == 8
    alone = plan_batch([12, 1, 1], SIZES, cap=4)
    assert alone.indices == (0,) and alone.rows == 12 and alone.size == 16


def test_errors():
    with pytest.raises(ValueError, match="nothing is queued"):
        plan_batch([], SIZES)
    with pytest.raises(ValueError, match="exceeds the largest compiled batch size 32"):
        plan_batch([33], SIZES)


def test_choose_batch_is_the_prefix():
    assert choose_batch([10, 10, 10, 5, 1], SIZES) == (3, 32)
    assert choose_batch([1, 1, 1], SIZES) == (3, 4)
