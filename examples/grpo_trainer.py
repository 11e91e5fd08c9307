"""An example GRPO trainer that rolls out through a BubbleSpec service.

It talks to the service only through the client SDK: every step it rolls out a batch
(prompts x samples at temperature 1, announcing the next step's prompts as lookahead so idle
workers pre-generate drafts for them), scores the completions with the task's verifiable
reward, computes group-relative advantages, takes a real gradient step on a local copy of the
policy, saves the new weights to a new directory and pushes them with ``update_policy``.

    bubblespec make-rlvr-model /tmp/rlvr-model           # a tiny policy trained on the task
    bubblespec up --model /tmp/rlvr-model --workers 2     # in another shell
    python examples/grpo_trainer.py --scheduler 127.0.0.1:50051 --model /tmp/rlvr-model \\
        --steps 3 --prompts 16 --samples 4

Weights directories must be readable by the workers (same machine or a shared filesystem).
The loss is the PPO-clipped surrogate with the service's per-token logprobs as the behaviour
policy, token-level normalisation and no KL term; with one update per rollout batch it is the
plain on-policy policy gradient.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from bubblespec.client import Prompt, RolloutClient, SamplingParams
from bubblespec.bench.rlvr import make_prompts, reward, token_entropy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", default="127.0.0.1:50051", help="scheduler address HOST:PORT")
    p.add_argument("--token", default="", help="trainer bearer token, if the scheduler wants one")
    p.add_argument("--model", required=True, help="initial policy directory (HuggingFace format)")
    p.add_argument("--out-dir", default="", help="where new policy versions go (default: a temp dir)")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=512, help="longest response")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--updates", type=int, default=1, help="gradient steps per rollout batch")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="padded tokens per forward pass")
    p.add_argument("--policy", default=None, help="scheduling policy: static | queue | longest-first")
    p.add_argument("--no-drafts", action="store_true", help="roll out without speculative drafts")
    p.add_argument("--seed", type=int, default=0, help="prompt set and torch seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p.parse_args(argv)


def group_advantages(keys: list[str], rewards: list[float], eps: float = 1e-4) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation."""
    groups: dict[str, list[float]] = defaultdict(list)
    for k, r in zip(keys, rewards):
        groups[k].append(r)
    stats = {}
    for k, rs in groups.items():
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
        stats[k] = (mean, std)
    return [(r - stats[k][0]) / (stats[k][1] + eps) for k, r in zip(keys, rewards)]


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped by similar length so that count x longest stays within ``budget``."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + [cur] if cur else out


def policy_loss(policy, rollouts: list[dict], args) -> dict:
    """One gradient step over the batch; returns entropy and logprob-mismatch statistics."""
    total_tokens = sum(len(r["response"]) for r in rollouts)
    stats = {"entropy": 0.0, "logprob_gap": 0.0, "clipped": 0}
    for mb in micro_batches([len(r["prompt"]) + len(r["response"]) for r in rollouts], args.micro_batch_tokens):
        rows = [rollouts[i] for i in mb]
        width = max(len(r["prompt"]) + len(r["response"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        resp = torch.zeros(len(rows), width, dtype=torch.bool)  # positions whose *next* token is sampled
        old = torch.zeros(len(rows), width)
        adv = torch.zeros(len(rows), width)
        for j, r in enumerate(rows):
            p, t = len(r["prompt"]), len(r["response"])
            ids[j, :p + t] = torch.tensor(r["prompt"] + r["response"])
            mask[j, :p + t] = 1
            resp[j, p - 1:p + t - 1] = True
            old[j, p - 1:p + t - 1] = torch.tensor(r["logprobs"])
            adv[j, p - 1:p + t - 1] = r["advantage"]
        logits = policy(input_ids=ids, attention_mask=mask).logits.float()
        logp_all = torch.log_softmax(logits, dim=-1)
        nxt = torch.cat([ids[:, 1:], torch.zeros(len(rows), 1, dtype=torch.long)], dim=1)
        logp = logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * adv)
        loss = -(surrogate * resp).sum() / total_tokens
        loss.backward()
        with torch.no_grad():
            stats["entropy"] += (token_entropy(logits) * resp).sum().item()
            stats["logprob_gap"] += ((logp - old).abs() * resp).sum().item()
            stats["clipped"] += int((((ratio - 1).abs() > args.clip) & resp).sum())
    return {k: v / total_tokens if k != "clipped" else v for k, v in stats.items()}


def save_policy(policy, base: str, path: Path) -> Path:
    """Weights (safetensors) plus the base directory's tokenizer files: a loadable model dir."""
    path.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(str(path), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(base) / name).exists():
            shutil.copy2(Path(base) / name, path / name)
    return path


def rollout(client, tok, step: int, texts: list[str], ahead: list[str], version: int, run: str, args):
    """Roll one step out through the service; return (result, prompts by id, seconds)."""
    def prompt(i: int, text: str) -> Prompt:
        return Prompt(f"q{i}", token_ids=tuple(tok.encode(text, add_special_tokens=False)))

    base = step * args.prompts
    prompts = [prompt(base + j, t) for j, t in enumerate(texts)]
    lookahead = [prompt(base + args.prompts + j, t) for j, t in enumerate(ahead)]
    t = time.monotonic()
    result = client.generate(f"grpo-{run}-{step}", prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens),
                             n=args.samples, policy_version=version, lookahead=lookahead,
                             policy=args.policy, drafts=not args.no_drafts)
    return result, {p.prompt_id: (p, text) for p, text in zip(prompts, texts)}, time.monotonic() - t


def report(step: int, result, rewards: list[float], stats: dict, times: dict) -> str:
    s = result.summary
    lengths = [len(c.token_ids) for c in result.completions]
    by_source = " ".join(f"{x.source}={x.accepted_tokens}/{x.drafted_tokens}" for x in s.provenance.sources) or "none"
    return (f"step {step}: reward {sum(rewards) / len(rewards):.3f} | len mean {sum(lengths) / len(lengths):.1f} "
            f"max {max(lengths)} | makespan {s.makespan_seconds:.2f}s fwd/token {s.forward_passes_per_token:.3f} "
            f"bubble {100 * s.bubble_share:.0f}% | accepted/drafted {by_source} | entropy {stats['entropy']:.3f} "
            f"| logprob gap {stats['logprob_gap']:.2e} | weight change rms {stats['update_rms']:.1e} "
            f"| rollout {times['rollout']:.1f}s train {times['train']:.1f}s "
            f"update {times['update']:.1f}s")


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    policy = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    texts = make_prompts(args.prompts * (args.steps + 1), seed=args.seed)
    batches = [texts[i * args.prompts:(i + 1) * args.prompts] for i in range(args.steps + 1)]
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bubblespec-grpo-"))
    run = time.strftime("%Y%m%d-%H%M%S")
    with RolloutClient(args.scheduler, token=args.token) as client:
        version = int(client.status()["policy_version"]) + 1
        t = time.monotonic()
        workers = client.update_policy(version, str(Path(args.model).resolve()))
        print(f"policy v{version} ({args.model}) loaded on {workers} workers in {time.monotonic() - t:.1f}s; "
              f"new versions go to {out_dir}", flush=True)
        for step in range(args.steps):
            ahead = batches[step + 1] if step + 1 < args.steps else []
            result, by_id, t_rollout = rollout(client, tok, step, batches[step], ahead, version, run, args)
            rewards = [reward(by_id[c.prompt_id][1], c.text) for c in result.completions]
            advantages = group_advantages([c.prompt_id for c in result.completions], rewards)
            rollouts = [{"prompt": list(by_id[c.prompt_id][0].token_ids), "response": list(c.token_ids),
                         "logprobs": list(c.logprobs), "advantage": a}
                        for c, a in zip(result.completions, advantages)]
            t = time.monotonic()
            before = [p.detach().clone() for p in policy.parameters()]
            for _ in range(args.updates):
                opt.zero_grad(set_to_none=True)
                stats = policy_loss(policy, rollouts, args)
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
            t_train = time.monotonic() - t
            # root mean square change of a weight in this step (what `bubblespec bench` imitates)
            stats["update_rms"] = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in
                                                zip(policy.parameters(), before)) / sum(b.numel() for b in before))
            t = time.monotonic()
            version += 1
            path = save_policy(policy, args.model, out_dir / f"v{version}")
            client.update_policy(version, str(path.resolve()))
            times = {"rollout": t_rollout, "train": t_train, "update": time.monotonic() - t}
            print(report(step + 1, result, rewards, stats, times), flush=True)


if __name__ == "__main__":
    train(parse_args())
