"""A tiny LoRA adapter for the tiny model (``tiny_model.build_tiny_model``), in PEFT's format.

``build_tiny_lora(path, seed=...)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` (``lora_A``/``lora_B`` weights of the attention and MLP
projections of every layer), what vLLM's LoRA loader reads, without PEFT installed. The
weights depend only on ``seed`` and are large enough that greedy output under the adapter
differs from the base model's: tests of LoRA serving can tell the two apart.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TARGET_MODULES", "build_tiny_lora"]

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections the adapter changes, in every layer."""


def build_tiny_lora(path: str | Path, *, seed: int = 1, rank: int = 8, scale: float = 0.5,
                    hidden_size: int = 128, num_layers: int = 2, base_model: str = "") -> Path:
    """Write a LoRA adapter (rank ``rank``, ``lora_alpha`` = 2 x rank) for the tiny model
    built with ``hidden_size`` and ``num_layers`` to ``path``; return the path. ``scale`` is
    the standard deviation of both ``lora_A`` and ``lora_B`` (PEFT starts ``lora_B`` at zero,
    which changes nothing: this is a trained adapter's stand-in)."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    inter = hidden_size * 2
    shapes = {"q_proj": (hidden_size, hidden_size), "k_proj": (hidden_size, hidden_size),
              "v_proj": (hidden_size, hidden_size), "o_proj": (hidden_size, hidden_size),
              "gate_proj": (hidden_size, inter), "up_proj": (hidden_size, inter), "down_proj": (inter, hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in TARGET_MODULES:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            d_in, d_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) * scale).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) * scale).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": list(TARGET_MODULES), "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": base_model, "inference_mode": True}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path
