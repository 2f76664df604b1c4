"""Compile options chosen per module by a trial (xlaserve.runtime.tuning): which modules get a
trial, the choice rule, results equal under every option, and the executable cache keeping the
choice with the executable. No timing is asserted."""
from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import lax

from xlaserve.runtime import tuning
from xlaserve.runtime.excache import ExecutableCache
from xlaserve.runtime.pjrt import (COMPILE_CHOICES, DEFAULT_CHOICE, Device, rewrite_depthwise_convolutions)

RNG = np.random.default_rng(5)
NUMBERS = ("NCHW", "OIHW", "NCHW")
X = RNG.standard_normal((2, 8, 6, 6)).astype(np.float32)
W_GROUPED = RNG.standard_normal((8, 2, 3, 3)).astype(np.float32)
W_DENSE = RNG.standard_normal((4, 8, 3, 3)).astype(np.float32)
W_DEPTHWISE = RNG.standard_normal((8, 1, 3, 3)).astype(np.float32)
YNN = "ynn-convolutions"


def _conv(x, w, groups):
    return (jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NUMBERS,
                                                 feature_group_count=groups)) + 1.0,)


def _module(w, groups) -> bytes:
    return jax.jit(lambda x, w: _conv(x, w, groups)).lower(X, w).as_text().encode()


GROUPED = _module(W_GROUPED, 4)         # 4 groups of 2 channels: left by the depthwise rewrite
DENSE = _module(W_DENSE, 1)
DEPTHWISE = _module(W_DEPTHWISE, 8)
NO_CONVOLUTION = jax.jit(lambda x: (jax.nn.relu(x) + 1.0,)).lower(X).as_text().encode()


@pytest.fixture(scope="module")
def device() -> Device:
    return Device("cpu")


def test_pick_takes_the_lowest_median_but_keeps_the_default_within_the_margin():
    assert tuning.pick({"default": [3.0, 1.0, 2.0], "b": [1.0, 1.1, 9.0]}) == "b"         # medians 2 vs 1.1
    assert tuning.pick({"default": [1.0], "b": [0.97]}) == "default"          # 3% better: within 5%
    assert tuning.pick({"default": [1.0], "b": [0.9]}, margin=0.2) == "default"
    assert tuning.pick({"default": [1.0], "b": [0.9], "c": [0.5]}) == "c"
    assert tuning.pick({"default": [], "b": [1.0]}) == "b"                     # only b was timed
    assert tuning.pick({}) == "default"


def test_only_modules_with_convolutions_get_a_trial(device):
    assert YNN in COMPILE_CHOICES["cpu"] and "xla-defaults" in COMPILE_CHOICES["cpu"]
    assert device.overrides("xla-defaults") == ()          # XLA's own settings, as jax.jit compiles
    every = (DEFAULT_CHOICE, *COMPILE_CHOICES["cpu"])
    assert device.compile_choices(GROUPED) == every
    assert device.compile_choices(DENSE) == every          # dense convolutions too: the path differs by model
    assert device.compile_choices(DEPTHWISE) == every
    # the load path writes depthwise convolutions out first: no convolution is left to try options on
    assert device.compile_choices(rewrite_depthwise_convolutions(DEPTHWISE)) == (DEFAULT_CHOICE,)
    tuned = tuning.compile_tuned(device, NO_CONVOLUTION)
    assert (tuned.choice, tuned.seconds, dict(tuned.times)) == (DEFAULT_CHOICE, 0.0, {})
    with pytest.raises(ValueError, match="no compile options named 'bogus'"):
        device.compile(NO_CONVOLUTION, "bogus")


def test_results_are_equal_under_every_compile_option(device):
    want = np.asarray(_conv(X, W_GROUPED, 4)[0])
    for choice in device.compile_choices(GROUPED):
        (got,) = device.execute(device.compile(GROUPED, choice), [X, W_GROUPED])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=choice)


def test_a_trial_times_every_candidate_and_logs_its_choice(device, caplog):
    with caplog.at_level(logging.INFO, "xlaserve.tuning"):
        tuned = tuning.compile_tuned(device, GROUPED, Path("model.b2.mlir"), budget=0.0)
    assert set(tuned.times) == set(device.compile_choices(GROUPED))
    assert all(len(t) == 1 for t in tuned.times.values())          # a zero budget: one round
    assert tuned.choice == tuning.pick(tuned.times) and tuned.seconds > 0
    assert f"compile options for model.b2.mlir: {tuned.choice}, chosen by a" in caplog.text
    (got,) = device.execute(tuned.executable, [X, W_GROUPED])
    np.testing.assert_allclose(got, np.asarray(_conv(X, W_GROUPED, 4)[0]), rtol=1e-5, atol=1e-5)


def test_trial_arguments_follow_the_signature(device):
    x, w = device.trial_arguments(GROUPED)
    assert (x.shape, x.dtype, w.shape, w.dtype) == (X.shape, np.float32, W_GROUPED.shape, np.float32)
    assert 0 < np.abs(x).max() < 1.0


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def test_the_cache_keeps_the_chosen_options_with_the_executable(device, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "pick", lambda times, **_: YNN)        # whatever the trial measured
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    exe, hit = cache.compile_module(Path("g.mlir"), GROUPED)
    assert not hit
    entry = cache.entry_path(cache.key(GROUPED)).read_bytes()
    assert f"\n{YNN}\n".encode() in entry[:400]
    monkeypatch.setattr(tuning, "pick", lambda times, **_: pytest.fail("a hit must not run a trial"))
    used = []
    real = Device.deserialize
    monkeypatch.setattr(Device, "deserialize", lambda self, blob, choice=DEFAULT_CHOICE:
                        used.append(choice) or real(self, blob, choice))
    exe2, hit2 = ExecutableCache(tmp_path / "c", device).compile_module(Path("g.mlir"), GROUPED)
    assert hit2 and used == [YNN]
    np.testing.assert_array_equal(device.execute(exe2, [X, W_GROUPED])[0], device.execute(exe, [X, W_GROUPED])[0])
    # a module without convolutions is stored with the default options, untried
    cache.compile_module(Path("d.mlir"), NO_CONVOLUTION)
    assert f"\n{DEFAULT_CHOICE}\n".encode() in cache.entry_path(cache.key(NO_CONVOLUTION)).read_bytes()[:400]


def test_an_entry_naming_unknown_options_is_rebuilt(device, tmp_path, caplog):
    cache = ExecutableCache(_private(tmp_path / "c"), device)
    key = cache.key(NO_CONVOLUTION)
    cache._write(cache.entry_path(key), key, device.compile(NO_CONVOLUTION), "from-a-newer-server")
    with caplog.at_level(logging.WARNING, "xlaserve.excache"):
        exe, hit = ExecutableCache(tmp_path / "c", device).compile_module(Path("d.mlir"), NO_CONVOLUTION)
    assert not hit and "compile options this server does not have ('from-a-newer-server')" in caplog.text
    assert ExecutableCache(tmp_path / "c", device).compile_module(Path("d.mlir"), NO_CONVOLUTION)[1]


def test_compile_choices_are_part_of_the_cache_key(device, monkeypatch):
    from xlaserve.runtime import pjrt

    before = device.cache_key_parts()["compile_options"]
    monkeypatch.setattr(pjrt, "COMPILE_CHOICES", {"cpu": {}})
    assert device.cache_key_parts()["compile_options"] != before
