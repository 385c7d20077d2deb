"""The generated code under pagedserve/v1 matches protos/ (regenerated with the pinned grpcio-tools)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale(tmp_path):
    protos = sorted((ROOT / "protos" / "pagedserve" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)], check=True)
    fresh = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(ROOT) for p in (ROOT / "pagedserve" / "v1").iterdir()
                 if p.is_file() and p.name != "__init__.py"}
    assert fresh == committed, "run `make protos`: generated files differ in name"
    stale = [str(p) for p in sorted(fresh) if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"run `make protos`: stale generated code {stale}"


@pytest.mark.parametrize("module", ["common", "generate", "scheduler", "worker"])
def test_generated_modules_import(module):
    __import__(f"pagedserve.v1.{module}_pb2_grpc")
