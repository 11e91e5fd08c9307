"""The committed gRPC stubs are exactly what scripts/gen-protos.sh produces from proto/."""

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_proto(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path / 'proto'}",
                    f"--python_out={tmp_path / 'proto'}", f"--pyi_out={tmp_path / 'proto'}",
                    f"--grpc_python_out={tmp_path / 'proto'}",
                    *map(str, (tmp_path / "proto/bubblespec/api/v1").glob("*.proto"))], check=True)
    generated = sorted(p.name for p in (tmp_path / "proto/bubblespec/api/v1").glob("*_pb2*"))
    assert generated, "protoc produced nothing"
    for name in generated:
        committed = ROOT / "proto/bubblespec/api/v1" / name
        assert committed.exists(), f"{name} is not committed: run scripts/gen-protos.sh"
        assert filecmp.cmp(committed, tmp_path / "proto/bubblespec/api/v1" / name, shallow=False), \
            f"{name} drifted from rollout.proto: run scripts/gen-protos.sh"
