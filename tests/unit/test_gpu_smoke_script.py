"""scripts/gpu-smoke.sh refuses to pass where it cannot test anything (the GPU tier itself is
tests/gpu; this machine-independent part runs everywhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

BASH = shutil.which("bash") or "/bin/bash"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-smoke.sh"


def run(*args: str, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run([BASH, str(SCRIPT), *args], check=False, capture_output=True, text=True, env=env, timeout=60)


def test_without_a_gpu_it_fails_before_installing_anything(tmp_path):
    # a PATH with the basic tools but no nvidia-smi
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "sed", "mktemp"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    done = run("--venv", str(tmp_path / "never-made"), path=str(bin_dir))
    assert done.returncode == 1, done
    assert done.stderr.strip().endswith("GPU SMOKE: FAIL - nvidia-smi sees no GPU (docker: --gpus; "
                                        "Kubernetes: an nvidia.com/gpu limit)"), done.stderr
    assert not (tmp_path / "never-made").exists()


def test_an_unknown_argument_is_refused_by_name(tmp_path):
    done = run("--tests-only", path=os.environ["PATH"])
    assert done.returncode == 2
    assert "unknown argument '--tests-only'" in done.stderr
