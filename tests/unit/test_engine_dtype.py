"""``EngineSettings.dtype="auto"`` on a CPU engine resolves to the checkpoint's own dtype."""

import json

import pytest

from bubblespec.worker.engine import _resolve_dtype


def test_auto_means_the_checkpoint_dtype_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU engines only")
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert _resolve_dtype("auto", str(tmp_path)) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))  # older transformers
    assert _resolve_dtype("auto", str(tmp_path)) == "bfloat16"
    assert _resolve_dtype("float16", str(tmp_path)) == "float16"  # an explicit choice stands
    assert _resolve_dtype("auto", str(tmp_path / "missing")) == "auto"
