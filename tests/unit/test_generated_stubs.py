"""The committed gRPC stubs match the .proto: regenerate and compare byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_fresh(tmp_path):
    proto = ROOT / "client/proto/lastgood/wire/v1/lastgood.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'client/proto'}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(proto)], check=True)
    for name in ("lastgood_pb2.py", "lastgood_pb2.pyi", "lastgood_pb2_grpc.py"):
        fresh = (tmp_path / "lastgood/wire/v1" / name).read_text()
        committed = (ROOT / "client/lastgood/wire/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make proto` and commit the result"
