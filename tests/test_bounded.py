"""Structured data from outside (a manifest, a node file) is refused before anything walks it
when its YAML aliases expand it past a bound or make it hold itself, and values in error
messages are shown cut short."""
from __future__ import annotations

from pathlib import Path

import pytest

from xlaserve.bounded import MAX_EXPANDED_VALUES, expansion_problem, shown
from xlaserve.bundle import read_manifest
from xlaserve.config import ConfigError, load_node_config
from xlaserve.errors import BundleError

def _yaml_bomb(levels: int) -> str:
    """``levels`` names of ten repeats each, in one flow list: 10^levels values."""
    return "[" + ", ".join(["&a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]) + "]"


#: 10^9 values in under 300 bytes of YAML
BOMB = _yaml_bomb(9)


def _bomb(levels: int):
    node: object = ["x"] * 10
    for _ in range(levels):
        node = [node] * 10          # one list, reached ten times: how YAML builds an alias
    return node


def test_shared_parts_are_counted_each_time_they_are_reached_but_walked_once():
    assert expansion_problem({"a": [1, 2, {"b": "c"}], "d": None}) is None
    assert expansion_problem(_bomb(3)) is None                      # 11,111 lists and strings: under the bound
    assert "more than 100,000 values" in expansion_problem(_bomb(4))
    assert "more than 100,000 values" in expansion_problem({"k": _bomb(9)})     # 10^10: answered at once
    assert "more than 100,000 values" in expansion_problem([("k", _bomb(9))])   # inside a tuple too
    assert expansion_problem(list(range(MAX_EXPANDED_VALUES - 1))) is None
    assert expansion_problem(list(range(MAX_EXPANDED_VALUES))) is not None


def test_data_that_holds_itself_is_named_and_deep_nesting_does_not_recurse():
    loop: list = [1]
    loop.append({"again": loop})
    assert "holds itself" in expansion_problem(loop)
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    assert expansion_problem(deep) is None


def test_shown_cuts_any_value_short():
    assert len(shown(_bomb(9))) <= 240 and len(shown("x" * 10_000)) < 100
    loop: list = [1]
    loop.append(loop)
    assert shown(loop) == "[1, [1, [...]]]"
    assert shown([1, "a"]) == "[1, 'a']"


def test_a_manifest_with_an_alias_bomb_is_a_bundle_error_not_a_hang(tmp_path: Path):
    # before the bound, format_version: *a8 hung in str(), and batching's message in repr()
    for key in ("format_version", "kind", "name"):
        bundle = tmp_path / key
        bundle.mkdir()
        (bundle / "manifest.yaml").write_text(f"{key}: {BOMB}\nformat_version: '2.0'\n"
                                              if key != "format_version" else f"{key}: {BOMB}\n")
        with pytest.raises(BundleError, match="manifest.yaml cannot be read: it expands to more than 100,000 "
                                              "values"):
            read_manifest(bundle)
    # !!omap and !!pairs build tuples, which hold aliases like lists: once a way past the walk
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "manifest.yaml").write_text(f"format_version: !!omap [{{a: {_yaml_bomb(6)}}}]\n")
    with pytest.raises(BundleError, match="it expands to more than 100,000 values"):
        read_manifest(wrapped)
    looped = tmp_path / "looped"
    looped.mkdir()
    (looped / "manifest.yaml").write_text("format_version: &v ['2.0', *v]\n")
    with pytest.raises(BundleError, match="holds itself"):
        read_manifest(looped)
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "manifest.yaml").write_text("format_version: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(BundleError, match="too deeply"):
        read_manifest(deep)


def test_a_node_file_with_an_alias_bomb_or_a_loop_is_a_config_error(tmp_path: Path):
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: m\nglobal: {{runtime: {{backend: {BOMB}}}}}\n")
    with pytest.raises(ConfigError, match=r"node.yaml: cannot be read: it expands to more than 100,000 values"):
        load_node_config(node)
    node.write_text("model_repo: m\nendpoints: &e [*e]\n")
    with pytest.raises(ConfigError, match="holds itself"):
        load_node_config(node)
    node.write_text("model_repo: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_node_config(node)
