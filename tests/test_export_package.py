"""The export package's face (xlaserve/export/__init__.py): every public name comes from the room
that defines it, the face loads a room only when one of its names is used, and the rooms share
only public names with each other."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

import xlaserve.export as face
from tests.conftest import ROOT

ROOMS = sorted(p.stem for p in (ROOT / "xlaserve" / "export").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", face.__all__)
def test_every_public_name_is_the_object_its_room_defines(name):
    room = importlib.import_module(f"xlaserve.export.{face._ROOMS[name]}")
    assert getattr(face, name) is getattr(room, name)
    assert name in room.__all__, f"{name} is public in the package but not in its room's __all__"


def test_an_unknown_name_is_an_attribute_error_that_names_it():
    with pytest.raises(AttributeError, match="no attribute 'export_onnx'"):
        face.export_onnx  # noqa: B018


def test_the_face_and_the_command_line_load_no_framework_until_an_export_needs_one():
    """``xlaserve --help`` builds the export command's parser: that, and a TensorSpec, must not
    cost a JAX, Flax or torch import."""
    code = ("import sys, xlaserve.export, xlaserve.export.cli; from xlaserve.export import TensorSpec; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'torch', 'torch_mlir'}))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert found.stdout.strip() == "[]"


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_no_private_name_of_another(room):
    tree = ast.parse((ROOT / "xlaserve" / "export" / f"{room}.py").read_text())
    taken = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("xlaserve.export") for alias in node.names]
    assert [t for t in taken if t[1].startswith("_")] == []
