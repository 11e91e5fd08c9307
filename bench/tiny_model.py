"""A tiny Llama-architecture model and character tokenizer, built deterministically.

Tests and the embedded demo need a real model that vLLM can load without any download.
``build_tiny_model(path)`` writes a HuggingFace-format directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ...) whose weights depend only on ``seed``.

The tokenizer has a ChatML-style chat template (``CHAT_TEMPLATE``, in ``tokenizer_config.json``)
with ``<s>`` and ``</s>`` as the turn markers, so that ``/v1/chat/completions`` can be tested.

``perturb_weights(src, dst, scale, seed)`` writes a copy with Gaussian noise added: a
stand-in for "the trainer took a gradient step" in tests of policy updates.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "TINY_VOCAB", "build_tiny_model", "build_tiny_tokenizer", "perturb_weights"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
#: Every token of the tiny tokenizer: specials, then printable ASCII, one character each.
TINY_VOCAB: list[str] = SPECIAL_TOKENS + [c for c in string.printable if c not in "\t\r\x0b\x0c"]
_VOCAB_SIZE = 128  # padded; ids past len(TINY_VOCAB) are never produced by the tokenizer
#: ChatML's layout with the tokens the tiny tokenizer has: ``<s>role\ncontent</s>\n`` per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer(path: str | Path) -> Path:
    """Write the tiny tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat
    template) to ``path``; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_len: int = 1024,
    init_scale: float = 0.15,
) -> Path:
    """Write a tiny float32 Llama model and its tokenizer to ``path``; return the path.

    ``init_scale`` is the weight standard deviation: large enough that next-token
    distributions are peaked (greedy margins well above float noise), small enough that the
    model is not degenerate.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        head_dim=64,
        max_position_embeddings=max_len,
        initializer_range=init_scale,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    build_tiny_tokenizer(path)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    return path


def perturb_weights(src: str | Path, dst: str | Path, *, scale: float, seed: int) -> Path:
    """Copy the model at ``src`` to ``dst`` with N(0, scale^2) noise added to every weight."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name != "model.safetensors":
            shutil.copy2(item, dst / item.name)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    noisy = {
        name: (t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)).contiguous()
        for name, t in tensors.items()
    }
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
