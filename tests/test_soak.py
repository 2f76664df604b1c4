"""The soak benchmark (``benchmarks/soak.py``, issue 14): its answer check tells versions apart,
and a few seconds of it against the real server pass with every request answered."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from benchmarks.soak import ModelSpec, check_answer, reload_weights
from tests.conftest import ROOT

MODEL = ModelSpec("m01", 1, 72)


def test_the_answer_check_holds_each_reply_to_the_version_it_names():
    x = np.random.default_rng(0).standard_normal((1, MODEL.width)).astype(np.float32)
    v2 = np.tanh(x @ reload_weights(MODEL, 2)).astype(np.float32)
    v3 = np.tanh(x @ reload_weights(MODEL, 3)).astype(np.float32)
    assert check_answer(MODEL, x, "2", v2, 2, reload_weights) is None
    assert check_answer(MODEL, x, "3", v3, 2, reload_weights) is None
    # the new version's answer labelled with the old version, and the reverse, are wrong
    assert "max |answer - reference|" in check_answer(MODEL, x, "2", v3, 2, reload_weights)
    assert "max |answer - reference|" in check_answer(MODEL, x, "3", v2, 2, reload_weights)
    # a correct answer from a version older than the one already serving is stale
    assert check_answer(MODEL, x, "2", v2, 3, reload_weights).startswith("stale")
    assert "not a number" in check_answer(MODEL, x, "", v2, 1, reload_weights)
    assert "output" in check_answer(MODEL, x, "2", v2[:, :8], 1, reload_weights)


def test_a_short_soak_answers_every_request_and_confirms_every_reload():
    out = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--duration", "3", "--concurrency", "8",
                          "--models", "2", "--reload-every", "1", "--client-processes", "2",
                          # RSS still grows while a 3 s run warms up; the 10-minute run judges it
                          "--max-rss-growth", "50"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (summary,) = map(json.loads, out.stdout.splitlines())
    assert summary["sent"] > 100 and summary["ok"] == summary["sent"], summary
    assert summary["statuses"] == {} and summary["wrong"] == summary["stale"] == 0
    assert [(m, v) for m, v, _ in summary["reloads"]] == [("m00", 2), ("m01", 2)]
    assert all(after is not None for _, _, after in summary["reloads"])
