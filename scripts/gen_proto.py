"""Regenerate xlaserve/_proto/ from proto/*.proto.

    python scripts/gen_proto.py            # rewrite the checked-in code
    python scripts/gen_proto.py --out DIR  # write into DIR instead (tests compare the two)

Runs grpcio-tools' bundled protoc with two generators: protobuf's own (`--python_out`,
`--pyi_out`: upb-backed message classes) and grpclib's plugin (`--grpclib_python_out`, which
ships with grpclib as `protoc-gen-grpclib_python`). Then it rewrites the output so that it can
live inside the package:

- imports become absolute within the package (`from xlaserve._proto import model_config_pb2`)
  instead of top-level (`import model_config_pb2`), which only works with proto/ on sys.path;
- descriptors go into xlaserve's own descriptor pool instead of protobuf's default pool.
  tritonclient registers the same file names (`grpc_service.proto`) and message names
  (`inference.ModelInferRequest`) in the default pool, and a process that imports both (the
  tests, a benchmark) would otherwise fail with "duplicate file name".

The output is deterministic: same protos and same grpcio-tools version give the same bytes.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
PACKAGE = "xlaserve._proto"
DEFAULT_OUT = REPO / "xlaserve" / "_proto"

# proto file stem -> whether it defines a service (and so gets a grpclib `_grpc.py` module).
PROTOS = {
    "model_config": False,
    "grpc_service": True,
    "xlaserve_control": True,
}

INIT = '''\
"""Generated protobuf and grpclib code: generated, do not edit; run scripts/gen_proto.py.

Sources are in proto/. Modules:

- ``grpc_service_pb2`` / ``grpc_service_grpc``: KServe V2 with Triton's extensions
  (package ``inference``, service ``GRPCInferenceService``).
- ``model_config_pb2``: the part of Triton's ModelConfig that xlaserve fills.
- ``xlaserve_control_pb2`` / ``xlaserve_control_grpc``: xlaserve's worker control service
  (package ``xlaserve.control``, service ``WorkerControl``).

Message classes are protobuf's upb-backed classes; ``*_grpc`` modules hold grpclib service bases
and stubs. Descriptors live in ``POOL``, not protobuf's default pool, so that tritonclient's own
generated code (same file and message names) can be imported in the same process.
"""

from google.protobuf import descriptor_pool as _descriptor_pool

POOL = _descriptor_pool.DescriptorPool()
'''


def _grpclib_plugin() -> Path:
    """The grpclib protoc plugin: next to this interpreter (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "protoc-gen-grpclib_python"
    if beside.exists():
        return beside
    found = shutil.which("protoc-gen-grpclib_python")
    if found is None:
        sys.exit("protoc-gen-grpclib_python not found: install grpclib into this interpreter")
    return Path(found)


def _fix_imports(text: str) -> str:
    stems = "|".join(PROTOS)
    # protobuf's gencode: `import model_config_pb2 as model__config__pb2`
    # grpclib's plugin and the .pyi: `import grpc_service_pb2` (optionally `as ...`)
    return re.sub(
        rf"^import ({stems})_pb2\b",
        rf"from {PACKAGE} import \1_pb2",
        text,
        flags=re.MULTILINE,
    )


def _use_own_pool(text: str) -> str:
    pool_call = "_descriptor_pool.Default().AddSerializedFile("
    if text.count(pool_call) != 1:
        raise RuntimeError("unexpected protobuf gencode: cannot find the descriptor pool call")
    text = text.replace(pool_call, "_POOL.AddSerializedFile(")
    marker = "# @@protoc_insertion_point(imports)\n"
    if marker not in text:
        raise RuntimeError("unexpected protobuf gencode: no imports insertion point")
    return text.replace(marker, marker + f"from {PACKAGE} import POOL as _POOL\n", 1)


def generate(out: Path) -> list[Path]:
    """Generate every module into `out` (created if missing); return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw_dir:
        raw = Path(raw_dir)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"--proto_path={PROTO_DIR}",
                f"--plugin=protoc-gen-grpclib_python={_grpclib_plugin()}",
                f"--python_out={raw}",
                f"--pyi_out={raw}",
                f"--grpclib_python_out={raw}",
                # Relative names, so no absolute path of this checkout leaks into the output.
                *(f"{stem}.proto" for stem in PROTOS),
            ],
            check=True,
            cwd=PROTO_DIR,
        )
        written = []
        for stem, has_service in PROTOS.items():
            names = [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
            if has_service:
                names.append(f"{stem}_grpc.py")
            for name in names:
                text = _fix_imports((raw / name).read_text())
                if name.endswith("_pb2.py"):
                    text = _use_own_pool(text)
                (out / name).write_text(text)
                written.append(out / name)
    (out / "__init__.py").write_text(INIT)
    written.append(out / "__init__.py")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: %(default)s")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
