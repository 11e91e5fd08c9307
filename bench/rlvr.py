"""A mini RLVR workload that runs on CPU: a verifiable task with long-tailed response lengths,
a supervised warm-start of the tiny Llama on it, and measurements of the resulting policy.

The task is step-by-step addition of a heavy-tailed number of small terms. Each term of the
prompt carries a letter label, and the response writes one labelled step per term, then the
answer after ``#``::

    prompt   a7+b2+c3=
    target   b:7+2=9;c:9+3=12;#12

The labels make "which term comes next" a content look-up (find ``c`` in the prompt) rather
than a position count, which a half-million-parameter Llama learns in minutes on a CPU; the
step structure then holds for 40 terms as well as for 2, so response lengths follow the term
count: most responses are short, a few are 10-20x longer, as in RL post-training rollouts.
docs/WORKLOAD.md has the measured numbers.

    prompts = make_prompts(64, seed=0)
    train_rlvr_model("/tmp/rlvr-model")          # HuggingFace dir, loadable by vLLM
    reward("a7+b2+c3=", "b:7+2=9;c:9+3=12;#12")  # 1.0: the answer after '#' is right

    python -m bubblespec.bench.rlvr /tmp/rlvr-model   # accuracy, lengths, token entropy

Torch and transformers are imported inside the functions that need them: the task itself
(prompts, targets, rewards) is plain Python.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import string
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bubblespec.bench.tiny_model import TINY_VOCAB, build_tiny_model

__all__ = [
    "EOS_ID", "TaskSettings", "TrainSettings", "decode", "encode", "ensure_trained", "evaluate", "is_trained",
    "length_stats", "make_prompts", "mean_token_entropy", "parse_prompt", "reward", "sample_responses",
    "target", "token_entropy", "train_rlvr_model",
]

logger = logging.getLogger(__name__)

EOS_ID = 2
"""``</s>`` in the tiny tokenizer: every target ends with it."""
LABELS = string.ascii_lowercase + string.ascii_uppercase
"""Term labels, in order: ``a``..``z`` then ``A``..``Z`` (52 terms at most)."""
_TOKEN_ID = {tok: i for i, tok in enumerate(TINY_VOCAB)}
_PROMPT_RE = re.compile(r"([a-zA-Z])(\d+)")
_STEP_RE = re.compile(r"([a-zA-Z]):(\d+)\+(\d+)=(\d+);")
_ANSWER_RE = re.compile(r"#(\d+)\s*$")


# --------------------------------------------------------------------------------------- task


@dataclass(frozen=True)
class TaskSettings:
    """The distribution of problems."""

    min_terms: int = 2
    """Fewest terms in a prompt."""
    max_terms: int = 40
    """Most terms in a prompt (at most 52, the number of labels)."""
    tail_exponent: float = 2.2
    """P(k terms) is proportional to k ** -tail_exponent: smaller means a heavier tail."""
    max_term: int = 9
    """Terms are drawn uniformly from 1..max_term."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= len(LABELS):
            raise ValueError(f"need 2 <= min_terms <= max_terms <= {len(LABELS)}")
        if self.max_term < 1:
            raise ValueError("max_term must be at least 1")


def make_prompts(n: int, seed: int, settings: TaskSettings = TaskSettings()) -> list[str]:
    """``n`` prompts such as ``a7+b2+c3=``; the same ``(n, seed, settings)`` gives the same list,
    and a longer list starts with the shorter one."""
    rng = random.Random(seed)
    counts = list(range(settings.min_terms, settings.max_terms + 1))
    weights = [k ** -settings.tail_exponent for k in counts]
    prompts = []
    for _ in range(n):
        k = rng.choices(counts, weights)[0]
        terms = [rng.randint(1, settings.max_term) for _ in range(k)]
        prompts.append("+".join(f"{LABELS[i]}{t}" for i, t in enumerate(terms)) + "=")
    return prompts


def parse_prompt(prompt: str) -> list[int]:
    """The terms of a prompt; ``ValueError`` if it is not one this task makes."""
    if not prompt.endswith("=") or len(prompt) < 2:
        raise ValueError(f"not a task prompt: {prompt[:40]!r}")
    parts = prompt[:-1].split("+")
    terms = []
    for i, part in enumerate(parts):
        m = _PROMPT_RE.fullmatch(part)
        if m is None or i >= len(LABELS) or m.group(1) != LABELS[i]:
            raise ValueError(f"not a task prompt: {prompt[:40]!r}")
        terms.append(int(m.group(2)))
    if len(terms) < 2:
        raise ValueError(f"not a task prompt: {prompt[:40]!r}")
    return terms


def _steps(terms: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """(label, running sum so far, term, new running sum) for each term after the first."""
    out, total = [], terms[0]
    for i, t in enumerate(terms[1:], start=1):
        out.append((LABELS[i], total, t, total + t))
        total += t
    return out


def target(prompt: str) -> str:
    """The reference response: one ``label:sum+term=sum;`` step per term, then ``#answer``."""
    terms = parse_prompt(prompt)
    return "".join(f"{lab}:{s}+{t}={r};" for lab, s, t, r in _steps(terms)) + f"#{sum(terms)}"


def reward(prompt: str, response_text: str, *, step_credit: float = 0.0) -> float:
    """1.0 if the response ends with ``#<the right sum>``, else ``step_credit`` times the share
    of reference steps the response got right, in order (0.0 by default: a binary reward).
    A malformed response (no final ``#<integer>``) earns only step credit."""
    terms = parse_prompt(prompt)
    text = response_text.replace("</s>", "")
    answer = _ANSWER_RE.search(text)
    if answer is not None and int(answer.group(1)) == sum(terms):
        return 1.0
    if step_credit <= 0.0:
        return 0.0
    expected = _steps(terms)
    got = [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in _STEP_RE.finditer(text)]
    right = 0
    for want, have in zip(expected, got):
        if want != have:
            break
        right += 1
    return step_credit * right / len(expected)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` in the tiny character tokenizer (no BOS, no EOS)."""
    try:
        return [_TOKEN_ID[c] for c in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the tiny vocabulary") from None


def decode(token_ids: Sequence[int]) -> str:
    """Text of ``token_ids``, special tokens dropped."""
    return "".join(TINY_VOCAB[t] for t in token_ids if 3 < t < len(TINY_VOCAB))


def _quantile(sorted_values: Sequence[int], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """p50 / p90 / p95 / p99 / max / mean of a list of lengths."""
    v = sorted(lengths)
    return {"n": len(v), "mean": sum(v) / len(v), "p50": _quantile(v, 0.5), "p90": _quantile(v, 0.9),
            "p95": _quantile(v, 0.95), "p99": _quantile(v, 0.99), "max": v[-1]}


# ----------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainSettings:
    """Supervised warm-start of the tiny Llama on the task (teacher forcing on prompt + target)."""

    steps: int = 1500
    """Optimizer steps."""
    hidden_size: int = 128
    """Model width (a multiple of 64, as build_tiny_model requires)."""
    num_layers: int = 3
    """Transformer layers."""
    head_dim: int = 32
    """Attention head width: hidden_size / head_dim heads per layer (build_tiny_model's 64-wide
    heads give a 128-wide model only two, which learns the label lookup much more slowly)."""
    max_len: int = 1024
    """Longest prompt + response the model is built for (vLLM's max_model_len)."""
    batch_tokens: int = 2048
    """Padded tokens per batch (sequences of similar length are batched together)."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 60
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    threads: int = 1
    """torch CPU threads while training (one is fastest on a busy two-core machine)."""
    pool_size: int = 4096
    """Fresh problems generated per data epoch (each epoch draws new ones)."""
    log_every: int = 50
    """Log the loss every this many steps (0 = never)."""


def _batches(seed: int, s: TrainSettings, task: TaskSettings) -> Iterator[list[list[list[int]]]]:
    """Endless batches of token sequences (prompt + target + EOS), similar lengths together."""
    epoch = 0
    while True:
        rng = random.Random(seed * 1_000_003 + epoch)
        prompts = make_prompts(s.pool_size, seed=rng.randrange(2**62), settings=task)
        seqs = sorted(([encode(p), encode(target(p)) + [EOS_ID]] for p in prompts),
                      key=lambda x: len(x[0]) + len(x[1]))
        batches, current = [], []
        for seq in seqs:
            longest = len(seq[0]) + len(seq[1])
            if current and (len(current) + 1) * longest > s.batch_tokens:
                batches.append(current)
                current = []
            current.append(seq)
        batches.append(current)
        rng.shuffle(batches)
        yield from batches
        epoch += 1


def _collate(batch: list[list[list[int]]]):
    """Right-padded ids, attention mask and labels (-100 on the prompt and the padding)."""
    import torch

    width = max(len(p) + len(r) for p, r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(batch):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(r)
    return ids, mask, labels


def _lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    done = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


class _TorchContext:
    """Thread count and deterministic algorithms for the duration of a block, then restored."""

    def __init__(self, threads: int | None):
        self.threads = threads

    def __enter__(self):
        import torch

        self._saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
        if self.threads:
            torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self._saved[0])
        torch.use_deterministic_algorithms(self._saved[1])


def _set_head_dim(path: Path, head_dim: int) -> None:
    """Re-split the attention projections into ``hidden / head_dim`` heads (same weight shapes)."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    if config["hidden_size"] % head_dim:
        raise ValueError(f"hidden_size {config['hidden_size']} is not a multiple of head_dim {head_dim}")
    heads = config["hidden_size"] // head_dim
    config.update(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=heads)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def train_rlvr_model(
    path: str | Path,
    seed: int = 0,
    steps: int | None = None,
    *,
    settings: TrainSettings = TrainSettings(),
    task: TaskSettings = TaskSettings(),
) -> dict:
    """Build the tiny Llama at ``path``, train it on the task, save it there; return stats.

    The directory has the layout ``build_tiny_model`` writes (config, safetensors weights,
    tokenizer files) and loads in transformers and vLLM. Same seed and settings, same
    weights (on the same machine and torch build)."""
    import torch
    from transformers import LlamaForCausalLM

    s = settings if steps is None else replace(settings, steps=steps)
    path = Path(path)
    build_tiny_model(path, seed=seed, hidden_size=s.hidden_size, num_layers=s.num_layers,
                     max_len=s.max_len, init_scale=0.02)
    _set_head_dim(path, s.head_dim)
    started = time.monotonic()
    with _TorchContext(s.threads):
        torch.manual_seed(seed)
        model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.98), weight_decay=s.weight_decay)
        batches = _batches(seed, s, task)
        losses: list[float] = []
        for step in range(s.steps):
            ids, mask, labels = _collate(next(batches))
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, s)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if s.log_every and (step + 1) % s.log_every == 0:
                recent = losses[-s.log_every:]
                logger.info("step %d/%d loss %.4f (%.0fs)", step + 1, s.steps, sum(recent) / len(recent),
                            time.monotonic() - started)
        model.eval()
        model.save_pretrained(str(path), safe_serialization=True)
    tail = losses[-max(1, min(50, len(losses))):]
    stats = {"path": str(path), "seed": seed, "seconds": round(time.monotonic() - started, 1),
             "final_loss": sum(tail) / len(tail), "parameters": sum(p.numel() for p in model.parameters()),
             "settings": asdict(s), "task": asdict(task)}
    (path / "rlvr_training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


# ------------------------------------------------------------------------------ the cache

_NOT_IN_RECIPE = ("log_every",)
"""Training settings that do not change the weights."""


def _recipe(seed: int, settings: dict, task: dict) -> dict:
    return {"seed": seed, "settings": {k: v for k, v in settings.items() if k not in _NOT_IN_RECIPE}, "task": task}


def is_trained(path: str | Path, seed: int = 0, *, settings: TrainSettings = TrainSettings(),
               task: TaskSettings = TaskSettings()) -> bool:
    """Whether ``path`` holds a finished ``train_rlvr_model`` run of this recipe (seed, training
    settings, task): its ``rlvr_training.json``, written after the weights, says so. A directory
    that only ``build_tiny_model`` wrote (random weights, training cut short) or one trained with
    other settings is not."""
    path = Path(path)
    try:
        stats = json.loads((path / "rlvr_training.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stats, dict) or not (path / "model.safetensors").is_file():
        return False
    found = _recipe(stats.get("seed"), stats.get("settings") or {}, stats.get("task"))
    return found == _recipe(seed, asdict(settings), asdict(task))


def ensure_trained(path: str | Path, seed: int = 0, *, settings: TrainSettings = TrainSettings(),
                   task: TaskSettings = TaskSettings()) -> dict | None:
    """Train the model into ``path`` unless ``is_trained`` says it is there already: None on a
    cache hit, else the training stats. Training runs in a sibling directory that replaces
    ``path`` only once finished, so an interrupted run leaves nothing a later one would take for
    a trained model."""
    path = Path(path)
    if is_trained(path, seed, settings=settings, task=task):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    work = path.with_name(f".{path.name}.training-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        stats = train_rlvr_model(work, seed, settings=settings, task=task)
        stats["path"] = str(path)
        (work / "rlvr_training.json").write_text(json.dumps(stats, indent=2) + "\n")
        if path.exists():
            path.rename(old)
        work.rename(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    logger.info("trained the RLVR model into %s in %.0fs", path, stats["seconds"])
    return stats


# -------------------------------------------------------------------------------- measurement


def token_entropy(logits):
    """Entropy in nats of the softmax of ``logits`` along the last axis (a torch tensor)."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _load(model):
    """A model object as is, or a model directory loaded for CPU inference."""
    if not isinstance(model, (str, Path)):
        return model
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()


def _by_length(prompts: Sequence[str], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of similar prompt length (a proxy for response length)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def sample_responses(model, prompts: Sequence[str], *, temperature: float = 1.0, seed: int = 0,
                     max_new_tokens: int | None = None, batch_size: int = 32,
                     threads: int | None = 1) -> list[list[int]]:
    """Response token ids for each prompt (ending with EOS unless cut at ``max_new_tokens``),
    sampled from the full distribution at ``temperature`` (0 = greedy), with transformers."""
    import torch

    model = _load(model)
    limit = model.config.max_position_embeddings
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False})
    out: list[list[int]] = [[] for _ in prompts]
    with _TorchContext(threads), torch.no_grad():
        torch.manual_seed(seed)
        for batch in _by_length(prompts, batch_size):
            ids = [encode(prompts[i]) for i in batch]
            width = max(map(len, ids))
            x = torch.tensor([[0] * (width - len(p)) + p for p in ids])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
            budget = min(max_new_tokens or limit, limit - width)
            gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=budget, eos_token_id=EOS_ID,
                                 pad_token_id=0, **sampling)
            for row, i in zip(gen[:, width:].tolist(), batch):
                out[i] = row[:row.index(EOS_ID) + 1] if EOS_ID in row else row
    return out


def _entropies(model, prompts: Sequence[str], responses: Sequence[Sequence[int]], batch_size: int) -> list[float]:
    """Entropy of the policy at every response position (teacher forcing), all sequences."""
    values: list[float] = []
    for batch in _by_length(prompts, batch_size):
        seqs = [(encode(prompts[i]), list(responses[i])) for i in batch if responses[i]]
        if not seqs:
            continue
        ids, mask, labels = _collate(seqs)
        ent = token_entropy(model(input_ids=ids, attention_mask=mask).logits[:, :-1])
        keep = labels[:, 1:] != -100
        values.extend(ent[keep].tolist())
    return values


def mean_token_entropy(model, prompts: Sequence[str], responses: Sequence[Sequence[int]] | None = None, *,
                       seed: int = 0, batch_size: int = 32, threads: int | None = 1) -> float:
    """Mean entropy (nats) of the policy's next-token distribution over response tokens.

    ``responses`` (token ids) default to samples at temperature 1 from the policy itself, the
    quantity that governs speculative acceptance in RL rollouts; pass targets to measure the
    entropy along the reference answers instead."""
    import torch

    model = _load(model)
    if responses is None:
        responses = sample_responses(model, prompts, temperature=1.0, seed=seed, batch_size=batch_size,
                                     threads=threads)
    with _TorchContext(threads), torch.no_grad():
        values = _entropies(model, prompts, responses, batch_size)
    return sum(values) / max(1, len(values))


def evaluate(model, prompts: Sequence[str], *, temperature: float = 0.0, seed: int = 0,
             batch_size: int = 32, threads: int | None = 1) -> dict:
    """Accuracy (overall and by term count), response lengths and stop rate of the policy."""
    model = _load(model)
    responses = sample_responses(model, prompts, temperature=temperature, seed=seed, batch_size=batch_size,
                                 threads=threads)
    rewards = [reward(p, decode(r)) for p, r in zip(prompts, responses)]
    buckets: dict[str, list[float]] = {"2-4": [], "5-9": [], "10+": []}
    for p, r in zip(prompts, rewards):
        k = len(parse_prompt(p))
        buckets["2-4" if k <= 4 else "5-9" if k <= 9 else "10+"].append(r)
    return {
        "accuracy": sum(rewards) / len(rewards),
        "accuracy_by_terms": {k: (sum(v) / len(v), len(v)) for k, v in buckets.items() if v},
        "stopped": sum(bool(r) and r[-1] == EOS_ID for r in responses) / len(responses),
        "lengths": length_stats([len(r) for r in responses]),
        "responses": responses,
    }


def _main(argv: Sequence[str] | None = None) -> None:
    """``python -m bubblespec.bench.rlvr DIR``: accuracy, lengths and entropy of a policy."""
    import argparse

    p = argparse.ArgumentParser(description=_main.__doc__)
    p.add_argument("model", help="model directory")
    p.add_argument("--prompts", type=int, default=256, help="held-out prompts to evaluate")
    p.add_argument("--seed", type=int, default=777, help="prompt seed (training draws other seeds)")
    a = p.parse_args(argv)
    model = _load(a.model)
    prompts = make_prompts(a.prompts, seed=a.seed)
    for name, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
        r = evaluate(model, prompts, temperature=temperature, seed=1)
        by_terms = ", ".join(f"{k} terms {acc:.3f} (n={n})" for k, (acc, n) in r["accuracy_by_terms"].items())
        lengths = ", ".join(f"{k} {r['lengths'][k]:.0f}" for k in ("mean", "p50", "p90", "p95", "p99", "max"))
        print(f"{name}: accuracy {r['accuracy']:.3f} [{by_terms}]; stopped {r['stopped']:.3f}")
        print(f"{name}: response tokens {lengths}")
    entropy = mean_token_entropy(model, prompts, r["responses"])
    short = [i for i, q in enumerate(prompts) if len(parse_prompt(q)) <= 4]
    entropy_short = mean_token_entropy(model, [prompts[i] for i in short], [r["responses"][i] for i in short])
    print(f"mean token entropy at temperature 1: {entropy:.4f} nats (2-4 term prompts: {entropy_short:.4f})")


if __name__ == "__main__":
    _main()
