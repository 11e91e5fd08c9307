"""The GPU tier: the CPU tier's exactness checks (tests/support/exactness.py) on a CUDA build of
vLLM (PyPI ``vllm``, ``bubblespec[worker]``). Every test here is skipped where there is no CUDA
GPU or no CUDA vLLM; ``scripts/gpu-smoke.sh`` runs them and fails if none ran.

Dtype: float32 (the tiny model's own), not vLLM's GPU ``auto`` (bfloat16 for a float32
checkpoint). Greedy identity compares the argmax of a verification pass (several positions of a
request scored at once, batched with whatever else runs) with that of plain decoding; in
bfloat16 the rounding depends on the batch's shape, so a near-tie can flip with no bug. In
float32 the tiny model's margins are far above the kernels' rounding, so the tolerance is none:
tokens must be identical, and the chi-square p-values must exceed 0.01 as on CPU.
``BUBBLESPEC_GPU_DTYPE=bfloat16`` runs the tier in the production dtype anyway (a greedy
mismatch there is a hint, not proof, of a bug).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bubblespec.worker.engine import VllmEngine
from bubblespec.bench.tiny_model import build_tiny_model
from tests.integration.conftest import engine_settings

HERE = Path(__file__).resolve().parent
DTYPE = os.environ.get("BUBBLESPEC_GPU_DTYPE", "float32")
# vLLM sizes the KV cache from a small share of the GPU: the two engines share one GPU, and the
# tiny model needs little. The CPU rejection-sampler fix does not apply to CUDA engines.
GPU = {"kv_cache_memory_bytes": 0, "gpu_memory_utilization": 0.15, "dtype": DTYPE, "max_num_seqs": 64}


def gpu_unavailable() -> str:
    """Why the GPU tier cannot run here; '' when it can."""
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU here (no nvidia-smi, no /dev/nvidiactl)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed (pip install 'bubblespec[worker]')"
    if not current_platform.is_cuda():
        return f"the installed vLLM is not a CUDA build (platform {current_platform.device_type!r})"
    return ""


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in item.path.parents]
    reason = gpu_unavailable() if mine else ""
    for item in mine if reason else ():
        item.add_marker(pytest.mark.skip(reason=f"GPU tier: {reason}"))


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("gpu-models") / "tiny"))


@pytest.fixture(scope="session")
async def gpu_reference(gpu_model):
    """A CUDA vLLM engine without speculation: the ground truth."""
    engine = VllmEngine(engine_settings(gpu_model, num_speculative_tokens=0, **GPU))
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
async def gpu_engine(gpu_model):
    """A CUDA vLLM engine with the BubbleSpec proposer, as a GPU worker runs it."""
    engine = VllmEngine(engine_settings(gpu_model, **GPU))
    await engine.start()
    yield engine
    await engine.shutdown()
