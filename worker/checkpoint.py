"""Checks a checkpoint directory before the engine loads it in place.

vLLM's in-place reload (``collective_rpc("reload_weights")``) copies whatever tensors it finds
into the running model and only *warns* about the ones it did not find: a checkpoint still
being written, or one of another model, would load as "ok" with a mix of old and new weights.
``check_checkpoint`` refuses such a directory before anything is copied, so a refused load
leaves the engine serving its previous weights intact.

What is checked, reading only safetensors headers (8-byte length + JSON; no tensor data, no
torch):

* the directory exists and holds ``config.json`` and safetensors weights;
* sharded (``model.safetensors.index.json`` present): the index parses, every file it names
  exists, every tensor it maps is in the file it names; unsharded: every ``*.safetensors`` file
  in the directory (what vLLM's loader reads);
* every file is whole: its size covers its header and the end of its last tensor (a file still
  being written is shorter), and no tensor appears in two files;
* the tensors are exactly the expected ones, each with the expected dtype and shape;
* ``config.json`` agrees with the expected config on every key that shapes the model vLLM
  built at start-up (:data:`ARCHITECTURE_KEYS`): an in-place reload cannot change those.

The expected tensors and config come from the checkpoint the engine **started with**
(:func:`read_checkpoint` on ``EngineSettings.model``), not from the model via
``collective_rpc``: the running model's parameters carry vLLM's fused names
(``qkv_proj``, ``gate_up_proj``) and tensor-parallel shards, whose mapping back to checkpoint
names is model-specific, while the start checkpoint's headers are in exactly the format a new
checkpoint must have, cost a few kilobytes to read, and hold for any parallelism. A new policy
of the same model has the same tensors, dtypes and shapes as the one the engine started with.

Limits: the files are checked, then read by vLLM; a file changed in between is not caught (a
trainer writes each version to a new directory). Tensor *values* are not checked.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURE_KEYS", "Checkpoint", "CheckpointError", "check_checkpoint", "read_checkpoint"]

INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
ARCHITECTURE_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "rms_norm_eps", "hidden_act",
    "sliding_window", "attention_bias", "mlp_bias",
)
"""``config.json`` keys that must agree with the start checkpoint (missing counts as ``None``)."""


class CheckpointError(ValueError):
    """A checkpoint refused before any weight was loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory holds: tensor name -> (dtype, shape), and its config."""

    path: str
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the structure of the checkpoint at ``path`` (no expectations)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"weights_path {str(path)!r} is not a directory")
    config = _read_json(root / "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{root / 'config.json'}: is not a JSON object")
    index = root / INDEX
    if index.exists():
        tensors = _read_sharded(root, index)
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors file (and no {INDEX})")
        tensors = {}
        for f in files:
            _merge(tensors, _read_header(f), f)
    return Checkpoint(str(root), {k: v[:2] for k, v in tensors.items()}, config)


def check_checkpoint(path: str | Path, expected: Checkpoint | None) -> Checkpoint:
    """Refuse (``CheckpointError``) a checkpoint that is incomplete or does not fit ``expected``
    (the engine's start checkpoint; ``None`` checks the directory's own consistency only)."""
    found = read_checkpoint(path)
    if expected is None:
        return found
    for name, (dtype, shape) in expected.tensors.items():
        got = found.tensors.get(name)
        if got is None:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        if got != (dtype, shape):
            raise CheckpointError(f"{path}: tensor {name!r} is {got[0]} {list(got[1])}, "
                                  f"the running model has {dtype} {list(shape)}")
    extra = sorted(set(found.tensors) - set(expected.tensors))
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]!r} is not in the running model "
                              f"({len(extra)} unexpected tensor(s))")
    for key in ARCHITECTURE_KEYS:
        if found.config.get(key) != expected.config.get(key):
            raise CheckpointError(f"{path}: config.json {key} is {found.config.get(key)!r}, "
                                  f"the running model has {expected.config.get(key)!r}")
    return found


def _read_sharded(root: Path, index: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: has no weight_map")
    headers: dict[str, dict] = {}
    for name in sorted(set(weight_map.values())):
        if not isinstance(name, str) or "/" in name or not (root / name).is_file():
            raise CheckpointError(f"{index}: names file {name!r}, which is not in {root}")
        headers[name] = _read_header(root / name)
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name, header in headers.items():
        _merge(tensors, header, root / name)
    for tensor, name in weight_map.items():
        if tensor not in headers[name]:
            raise CheckpointError(f"{index}: maps tensor {tensor!r} to {name}, which does not hold it")
    unmapped = sorted(set(tensors) - set(weight_map))
    if unmapped:
        raise CheckpointError(f"{index}: is incomplete: tensor {unmapped[0]!r} is not in its weight_map")
    return tensors


def _merge(tensors: dict, header: dict, file: Path) -> None:
    for name, (dtype, shape) in header.items():
        if name in tensors:
            raise CheckpointError(f"tensor {name!r} is in both {tensors[name][2]} and {file.name}")
        tensors[name] = (dtype, shape, file.name)


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file; refuses a truncated file."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated ({size} bytes, no safetensors header)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(f"{file}: truncated or not safetensors (header of {length} bytes, file of {size})")
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{file}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: safetensors header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, stop = str(info["dtype"]), tuple(int(d) for d in info["shape"]), int(info["data_offsets"][1])
            end = max(end, stop)
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry") from None
        out[name] = (dtype, shape)
    if 8 + length + end > size:
        raise CheckpointError(f"{file}: truncated: its tensors end at byte {8 + length + end}, the file has {size}")
    return out


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read: {exc.strerror or exc}") from None
    except ValueError:
        raise CheckpointError(f"{file}: is not valid JSON") from None
