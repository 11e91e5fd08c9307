"""The worker's checkpoint check (``worker/checkpoint.py``) on real safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from bubblespec.worker.checkpoint import INDEX, CheckpointError, check_checkpoint, read_checkpoint

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16,
          "num_hidden_layers": 1, "transformers_version": "4.0"}
TENSORS = {"embed.weight": np.zeros((16, 8), np.float32), "layer.weight": np.ones((8, 8), np.float32),
           "lm_head.weight": np.zeros((16, 8), np.float32)}


def write(path: Path, tensors=TENSORS, config=CONFIG, shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(dict(tensors), str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture
def start(tmp_path):
    return read_checkpoint(write(tmp_path / "start"))


def refused(path, expected, *words):
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(path, expected)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_same_model_passes_unsharded_and_sharded(tmp_path, start):
    assert check_checkpoint(write(tmp_path / "v1"), start).tensors == start.tensors
    assert check_checkpoint(write(tmp_path / "v2", shards=2), start).tensors == start.tensors
    other = dict(CONFIG, transformers_version="9.9", use_cache=False)  # keys that do not shape the model
    check_checkpoint(write(tmp_path / "v3", config=other), start)


def test_missing_directory_file_or_config(tmp_path, start):
    refused(tmp_path / "nowhere", start, "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, start, "config.json", "missing")
    (empty / "config.json").write_text(json.dumps(CONFIG))
    refused(empty, start, "no *.safetensors")
    (empty / "config.json").write_text("{not json")
    refused(empty, start, "config.json", "not valid JSON")


def test_missing_extra_or_reshaped_tensor_is_named(tmp_path, start):
    refused(write(tmp_path / "a", {k: v for k, v in TENSORS.items() if k != "lm_head.weight"}), start,
            "'lm_head.weight' is missing")
    refused(write(tmp_path / "b", {**TENSORS, "extra.bias": np.zeros(2, np.float32)}), start, "'extra.bias'")
    refused(write(tmp_path / "c", {**TENSORS, "layer.weight": np.ones((8, 4), np.float32)}), start,
            "'layer.weight'", "[8, 4]", "[8, 8]")
    refused(write(tmp_path / "d", {**TENSORS, "layer.weight": np.ones((8, 8), np.float16)}), start,
            "'layer.weight'", "F16", "F32")


def test_truncated_file_is_refused(tmp_path, start):
    path = write(tmp_path / "v")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-10])  # still being written
    refused(path, start, "model.safetensors", "truncated")
    (path / "model.safetensors").write_bytes(data[:5])
    refused(path, start, "truncated")
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(path, start, "model.safetensors")


def test_sharded_index_must_be_whole(tmp_path, start):
    path = write(tmp_path / "v", shards=3)
    index = json.loads((path / INDEX).read_text())
    (path / "model-00003-of-00003.safetensors").unlink()  # a shard not written yet
    refused(path, start, "model-00003-of-00003.safetensors", "not in")
    path = write(tmp_path / "w", shards=2)  # embed + lm_head in the first file, layer in the second
    index = json.loads((path / INDEX).read_text())
    partial = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != "lm_head.weight"})
    (path / INDEX).write_text(json.dumps(partial))
    refused(path, start, "incomplete", "'lm_head.weight'")
    (path / INDEX).write_text(json.dumps(dict(index, weight_map={k: v for k, v in index["weight_map"].items()
                                                                 if k != "layer.weight"})))
    refused(path, start, "'layer.weight' is missing")  # its file is not named: vLLM would not read it
    wrong = dict(index, weight_map={**index["weight_map"], "layer.weight": "model-00001-of-00002.safetensors"})
    (path / INDEX).write_text(json.dumps(wrong))
    refused(path, start, "'layer.weight'", "does not hold it")
    (path / INDEX).write_text("{")
    refused(path, start, INDEX, "not valid JSON")


def test_tensor_in_two_files_and_config_of_another_model(tmp_path, start):
    path = write(tmp_path / "v")
    save_file({"layer.weight": TENSORS["layer.weight"]}, str(path / "more.safetensors"))
    refused(path, start, "'layer.weight'", "both")
    refused(write(tmp_path / "w", config=dict(CONFIG, num_hidden_layers=2)), start, "num_hidden_layers")
