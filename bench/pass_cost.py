"""Per-pass cost of a 7B-sized Llama in plain PyTorch, by batch and draft length.

The simulator's ``gpu-h100-7b`` profile (``bench/sim/costs.py``) charges one engine forward pass
``base + per_seq * batch + per_draft_token * draft_tokens`` and a prefilled prompt
``prefill_per_token * tokens``. This script measures those passes on a GPU and fits the four
constants, so the profile rests on a measurement rather than on published figures.

What one measured pass is. A decode step of a continuous batch: ``batch`` sequences, each with
``ctx`` tokens already in its KV cache, each scoring ``1 + k`` positions (its next token and ``k``
draft tokens, as vLLM's verification pass does), the new keys and values written to the cache,
logits for every scored position and their argmax. A prefill pass is one sequence of ``P``
prompt tokens with logits for the last position only. The model is Llama-2-7B's shape (4,096
wide, 32 layers, 32 heads, 11,008 MLP, 32,000 vocabulary; ``--kv-heads 8`` for a grouped-query
variant) with random bfloat16 weights: time does not depend on the weights' values. Each shape
is captured in a CUDA graph (no Python or launch overhead, as vLLM's CUDA graphs) and replayed;
the median replay time, timed with CUDA events, is the point.

What it is not. Plain PyTorch's attention (``scaled_dot_product_attention`` over a contiguous
cache, its causal bias aligned lower right as vLLM's varlen flash kernels align it, so that
PyTorch can pick its flash kernel), not vLLM's paged kernels; no tensor parallelism; no sampler beyond argmax. Where the KV
caches of all 32 layers do not fit beside the weights, layers share cache buffers (each still
far larger than the L2 cache, so every layer reads its bytes from device memory).

Usage (on a GPU machine; only torch and numpy are needed)::

    python3 bench/pass_cost.py --out pass_cost.json              # the grid, then the fit
    python3 bench/pass_cost.py --device cpu --tiny --out x.json  # a smoke test of the code

``fit_profile`` (used by the tests and by ``--fit FILE``) turns the measured points into the
profile's constants: least squares over the points inside the draft-length rule's regime.
``fit_context_profile`` fits them with the context as a variable too (the simulator's
``gpu-h100-7b-context`` profile), where the report has a context sweep;
``fit_speculation_profile`` with a pass's fixed and per-sequence costs of verifying drafts
(``gpu-h100-7b-flash``). ``--attention`` pins every pass to one attention kernel.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

__all__ = ["SHAPES", "LlamaShape", "faster_of", "fit_context_profile", "fit_profile", "fit_speculation_profile", "main"]


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of the measured model."""

    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    ffn: int = 11008
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def params(self) -> int:
        d, hd = self.dim, self.head_dim
        per_layer = d * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * d + 3 * d * self.ffn + 2 * d
        return self.layers * per_layer + 2 * self.vocab * d + d

    def kv_bytes_per_token_layer(self, elem: int = 2) -> int:
        return 2 * self.kv_heads * self.head_dim * elem


TINY = LlamaShape(dim=64, layers=2, heads=4, kv_heads=4, ffn=128, vocab=256)

SHAPES: dict[str, LlamaShape] = {
    "llama2-7b": LlamaShape(),
    # Qwen2.5-7B's config.json: hidden 3,584, 28 layers, 28 query heads and 4 KV heads of 128,
    # intermediate 18,944, vocabulary 152,064 (its q/k/v biases are left out: 0.01% of the weights).
    "qwen2.5-7b": LlamaShape(dim=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064),
}
"""Measured model shapes by ``--shape`` name; ``--kv-heads`` overrides the KV heads of llama2-7b."""


# ------------------------------------------------------------------------------------------ fit


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(ys, dtype=float), rcond=None)
    return [float(c) for c in coef]


def fit_profile(report: dict, token_budget: int = 256) -> dict:
    """The profile's constants from a report's points.

    Decode points at the report's main context with ``batch * k <= token_budget`` (the regime the
    simulator's draft-length rule keeps passes in) fit ``base + per_seq * batch + per_draft_token
    * batch * k``; prefill points fit ``a + prefill_per_token * P``. Raises ``ValueError`` when
    the points cannot determine a constant. ``max_rel_error`` is the fit's worst relative miss
    over the points it used; ``outside`` lists the points beyond the budget and how far the
    linear model under-charges them (the compute-bound knee)."""
    ctx = report["ctx"]
    decode = [p for p in report["decode"] if p["ctx"] == ctx]
    used = [p for p in decode if p["batch"] * p["k"] <= token_budget]
    if len({p["batch"] for p in used}) < 2 or len({p["batch"] * p["k"] for p in used}) < 2:
        raise ValueError("decode points: need at least two batch sizes and two draft-token totals inside the budget")
    base, per_seq, per_draft = _lstsq([[1.0, p["batch"], p["batch"] * p["k"]] for p in used],
                                      [p["seconds"] for p in used])

    def model(p: dict) -> float:
        return base + per_seq * p["batch"] + per_draft * p["batch"] * p["k"]

    errors = [abs(model(p) - p["seconds"]) / p["seconds"] for p in used]
    prefill = report.get("prefill", [])
    if len({p["tokens"] for p in prefill}) < 2:
        raise ValueError("prefill points: need at least two prompt lengths")
    _, per_prompt = _lstsq([[1.0, p["tokens"]] for p in prefill], [p["seconds"] for p in prefill])
    outside = [{"batch": p["batch"], "k": p["k"], "measured": p["seconds"], "model": model(p)}
               for p in decode if p["batch"] * p["k"] > token_budget]
    return {"base_seconds": base, "per_seq_seconds": per_seq, "per_draft_token_seconds": per_draft,
            "prefill_per_token_seconds": per_prompt, "points_used": len(used), "token_budget": token_budget,
            "max_rel_error": max(errors), "median_rel_error": statistics.median(errors), "outside": outside}


def fit_speculation_profile(report: dict, token_budget: int = 256) -> dict:
    """``fit_profile``'s decode fit with the two costs of a pass with drafts beyond its draft
    tokens: ``base + per_seq * batch + spec_pass * [k > 0] + per_drafted_seq * batch * [k > 0]
    + per_draft_token * batch * k`` over the same points (every sequence of a measured pass
    verifies ``k``). Raises ``ValueError`` unless the points have passes with and without drafts
    at two batch sizes and two draft lengths."""
    ctx = report["ctx"]
    used = [p for p in report["decode"] if p["ctx"] == ctx and p["batch"] * p["k"] <= token_budget]
    drafted = [p for p in used if p["k"] > 0]
    if (len({p["batch"] for p in used if p["k"] == 0}) < 2 or len({p["batch"] for p in drafted}) < 2
            or len({p["k"] for p in drafted}) < 2):
        raise ValueError("decode points: need passes without drafts at two batch sizes, and with drafts at two "
                         "batch sizes and two draft lengths, inside the budget")
    rows = [[1.0, p["batch"], float(p["k"] > 0), p["batch"] * float(p["k"] > 0), p["batch"] * p["k"]] for p in used]
    ys = [p["seconds"] for p in used]
    coef = _lstsq(rows, ys)
    errors = [abs(sum(c * x for c, x in zip(coef, row)) - y) / y for row, y in zip(rows, ys)]
    base, per_seq, spec_pass, per_drafted_seq, per_draft = coef
    return {"base_seconds": base, "per_seq_seconds": per_seq, "spec_pass_seconds": spec_pass,
            "per_drafted_seq_seconds": per_drafted_seq, "per_draft_token_seconds": per_draft,
            "points_used": len(used), "token_budget": token_budget, "max_rel_error": max(errors),
            "median_rel_error": statistics.median(errors)}


def fit_context_profile(report: dict, token_budget: int = 256) -> dict:
    """The context-aware profile's decode constants: every decode and context-sweep point with
    ``batch * k <= token_budget`` fits ``base + per_seq * batch + per_context_token * batch * ctx
    + per_draft_token * batch * k + per_draft_context_token * batch * k * ctx`` (each sequence
    holds ``ctx`` tokens and verifies ``k``). Raises ``ValueError`` unless the points span two
    contexts. ``flat_median_rel_error`` is the context-blind fit's over the same points."""
    used = [p for p in [*report["decode"], *report.get("context", [])] if p["batch"] * p["k"] <= token_budget]
    if len({p["ctx"] for p in used}) < 2:
        raise ValueError("context points: need decode points at two or more contexts")
    if len({p["batch"] for p in used}) < 2 or len({p["batch"] * p["k"] for p in used}) < 2:
        raise ValueError("decode points: need at least two batch sizes and two draft-token totals inside the budget")
    ys = [p["seconds"] for p in used]

    rows = [[1.0, p["batch"], p["batch"] * p["ctx"], p["batch"] * p["k"], p["batch"] * p["k"] * p["ctx"]] for p in used]
    flat_rows = [[r[0], r[1], r[3]] for r in rows]  # the context-blind model of ``fit_profile``

    def rel_errors(coef: list[float], xs: list[list[float]]) -> list[float]:
        return [abs(sum(c * x for c, x in zip(coef, row)) - y) / y for row, y in zip(xs, ys)]

    coef = _lstsq(rows, ys)
    errors, flat_errors = rel_errors(coef, rows), rel_errors(_lstsq(flat_rows, ys), flat_rows)
    base, per_seq, per_ctx, per_draft, per_draft_ctx = coef
    return {"base_seconds": base, "per_seq_seconds": per_seq, "per_context_token_seconds": per_ctx,
            "per_draft_token_seconds": per_draft, "per_draft_context_token_seconds": per_draft_ctx,
            "points_used": len(used), "token_budget": token_budget, "max_rel_error": max(errors),
            "median_rel_error": statistics.median(errors), "flat_median_rel_error": statistics.median(flat_errors),
            "flat_max_rel_error": max(flat_errors)}


def faster_of(reports: list[dict]) -> dict:
    """One report whose every point is the least time any of ``reports`` measured for it (points
    that all of them measured; the first report's other fields). For reports of one model and
    machine under different attention layouts (``--pack-gqa`` or not), where each layout's
    kernel loses at some shapes and an engine's kernel picks its layout by shape."""
    def key(p: dict) -> tuple:
        return p.get("batch"), p.get("ctx"), p.get("k"), p.get("tokens")

    out = {**reports[0], "faster_of": [{"attention": r.get("attention"), "pack_gqa": r.get("pack_gqa", False)}
                                       for r in reports]}
    for part in ("decode", "context", "prefill"):
        by_key = [{key(p): p for p in r.get(part, [])} for r in reports]
        common = [k for k in by_key[0] if all(k in b for b in by_key[1:])]
        out[part] = [min((b[k] for b in by_key), key=lambda p: p["seconds"]) for k in common]
    return out


# ------------------------------------------------------------------------------------ the model


class Model:
    """A Llama forward pass in plain PyTorch over preallocated KV caches."""

    def __init__(self, shape: LlamaShape, device: str, dtype, seed: int = 0) -> None:
        import torch

        self.torch, self.shape, self.device, self.dtype = torch, shape, device, dtype
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*size: int):
            return (torch.randn(*size, generator=g, device=device, dtype=torch.float32 if device == "cpu" else dtype)
                    * 0.02).to(dtype)

        d, hd, s = shape.dim, shape.head_dim, shape
        self.embed = w(s.vocab, d)
        self.head = w(d, s.vocab)
        self.final_norm = torch.ones(d, device=device, dtype=dtype)
        self.layers = [{"qkv": w(d, (s.heads + 2 * s.kv_heads) * hd), "o": w(s.heads * hd, d),
                        "gate_up": w(d, 2 * s.ffn), "down": w(s.ffn, d),
                        "n1": torch.ones(d, device=device, dtype=dtype),
                        "n2": torch.ones(d, device=device, dtype=dtype)} for _ in range(s.layers)]
        self.attention = "auto"  # or an SDPA backend every pass is pinned to (``attention_context``)
        self.pack_gqa = False  # grouped-query attention as one head per KV head (``--pack-gqa``)
        self.caches: list[tuple] = []  # the rest is set by ``prepare`` for each measured shape
        self.mask = None
        self.rope: tuple | None = None
        self.ctx = 0

    def prepare(self, batch: int, ctx: int, q_len: int, kv_budget_bytes: int) -> int:
        """Allocate caches for ``batch`` x ``ctx + q_len`` tokens (random contents), the mask and
        the rotary tables. Returns how many distinct cache buffers the layers use."""
        torch, s = self.torch, self.shape
        self.caches = []
        if self.device != "cpu":
            torch.cuda.empty_cache()
        total = ctx + q_len
        per_layer = batch * total * s.kv_bytes_per_token_layer(torch.finfo(self.dtype).bits // 8)
        buffers = max(1, min(s.layers, kv_budget_bytes // max(1, per_layer)))
        for _ in range(buffers):
            k = torch.randn(batch, s.kv_heads, total, s.head_dim, device=self.device, dtype=self.dtype)
            self.caches.append((k, torch.randn_like(k)))
        if q_len > 1:  # query i (at position ctx + i) sees positions <= ctx + i: causal, aligned lower right
            from torch.nn.attention.bias import causal_lower_right

            self.mask = causal_lower_right(q_len, total)
        else:
            self.mask = None
        pos = torch.arange(ctx, total, device=self.device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, s.head_dim, 2, device=self.device, dtype=torch.float32) / s.head_dim))
        ang = pos[:, None] * inv[None, :]
        self.rope = (ang.cos().to(self.dtype), ang.sin().to(self.dtype))
        self.ctx = ctx
        return buffers

    def attention_context(self):
        """A context pinning ``scaled_dot_product_attention`` to ``self.attention``'s backend; a
        no-op for ``auto``, where PyTorch picks for each shape, so a pass with drafts (its causal
        bias aligned lower right) and a pass without may run different kernels."""
        import contextlib

        if self.attention == "auto":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[self.attention]
        return sdpa_kernel([backend])

    def _rms(self, x, weight):
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(self.dtype) * weight

    def _rotate(self, x):  # x: (B, heads, T, D)
        cos, sin = self.rope
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return self.torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, tokens, all_logits: bool = True):
        batch, q_len = tokens.shape
        x = self.embed[tokens]
        with self.attention_context():
            return self._layers(x, batch, q_len, all_logits)

    def _layers(self, x, batch: int, q_len: int, all_logits: bool):
        torch, s = self.torch, self.shape
        F = torch.nn.functional
        hd, ctx = s.head_dim, self.ctx
        for i, layer in enumerate(self.layers):
            kc, vc = self.caches[i % len(self.caches)]
            h = self._rms(x, layer["n1"]) @ layer["qkv"]
            q, k, v = h.split((s.heads * hd, s.kv_heads * hd, s.kv_heads * hd), dim=-1)
            q = self._rotate(q.view(batch, q_len, s.heads, hd).transpose(1, 2))
            k = self._rotate(k.view(batch, q_len, s.kv_heads, hd).transpose(1, 2))
            kc[:, :, ctx:ctx + q_len].copy_(k)
            vc[:, :, ctx:ctx + q_len].copy_(v.view(batch, q_len, s.kv_heads, hd).transpose(1, 2))
            if self.pack_gqa and s.kv_heads != s.heads:
                # each KV head's query heads as one head of group x q_len queries: the cache is read
                # once per KV head, as vLLM's GQA-aware kernels read it (PyTorch's flash kernel with
                # enable_gqa and a mask expands the cache to every query head). The causal order
                # among the q_len new positions is not applied: the same bytes and, to within the
                # q_len x q_len corner, the same arithmetic; exact for passes without drafts.
                packed = q.reshape(batch, s.kv_heads, (s.heads // s.kv_heads) * q_len, hd)
                o = F.scaled_dot_product_attention(packed, kc, vc).view(batch, s.heads, q_len, hd)
            else:
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=self.mask, enable_gqa=s.kv_heads != s.heads)
            o = o.transpose(1, 2).reshape(batch, q_len, s.heads * hd)
            x = x + o @ layer["o"]
            gate, up = (self._rms(x, layer["n2"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        x = self._rms(x if all_logits else x[:, -1:], self.final_norm)
        return (x @ self.head).argmax(-1)


# ----------------------------------------------------------------------------------- measuring


def attention_kernels(model: Model, tokens, all_logits: bool) -> list[str]:
    """The names of the GPU kernels one eager pass of this shape ran for attention (from the
    profiler), so a report says which kernel each point timed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(tokens, all_logits)
        model.torch.cuda.synchronize()
    marks = ("attn", "attention", "fmha", "flash", "sdpa", "cudnn", "softmax")
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA" and any(m in e.name.lower() for m in marks)}
    return sorted(n[:120] for n in names)


def time_pass(model: Model, batch: int, ctx: int, q_len: int, *, all_logits: bool, kv_budget: int,
              graph: bool, target_s: float) -> dict:
    """Median seconds of one pass of this shape (CUDA-graph replays timed with events on a GPU)."""
    torch = model.torch
    buffers = model.prepare(batch, ctx, q_len, kv_budget)
    tokens = torch.randint(0, model.shape.vocab, (batch, q_len), device=model.device)
    times: list[float] = []
    if model.device == "cpu":
        model.forward(tokens, all_logits)
        for _ in range(3):
            t0 = time.perf_counter()
            model.forward(tokens, all_logits)
            times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times), "min_seconds": min(times), "reps": 3, "kv_buffers": buffers,
                "graph": False}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model.forward(tokens, all_logits)
    torch.cuda.current_stream().wait_stream(stream)
    kernels = attention_kernels(model, tokens, all_logits)
    run = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model.forward(tokens, all_logits)
        run = g.replay
    else:
        def run():
            model.forward(tokens, all_logits)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) / 1e3
    reps = max(5, min(40, int(target_s / max(estimate, 1e-4))))
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    if graph:
        del g
    return {"seconds": statistics.median(times), "min_seconds": min(times), "reps": reps, "kv_buffers": buffers,
            "graph": graph, "attention_kernels": kernels}


def measure(args: argparse.Namespace) -> dict:
    import torch

    if args.tiny:
        shape = TINY
    elif args.shape == "llama2-7b":
        shape = LlamaShape(kv_heads=args.kv_heads)
    else:
        shape = SHAPES[args.shape]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    t_start = time.perf_counter()
    model = Model(shape, args.device, dtype)
    model.attention = args.attention
    model.pack_gqa = args.pack_gqa
    weight_bytes = shape.params() * (torch.finfo(dtype).bits // 8)
    if args.device == "cpu":
        kv_budget = 1 << 30
        device_name = platform.processor() or "cpu"
    else:
        free, _total = torch.cuda.mem_get_info()
        kv_budget = int(free * 0.6)
        device_name = torch.cuda.get_device_name(0)
    report = {"device": device_name, "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
              "shape": asdict(shape), "attention": args.attention, "pack_gqa": args.pack_gqa, "params": shape.params(),
              "weight_bytes": weight_bytes, "ctx": args.ctx, "kv_budget_bytes": kv_budget,
              "decode": [], "prefill": [], "context": []}
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.draft_lengths.split(",")]

    def point(batch: int, ctx: int, k: int) -> dict:
        r = time_pass(model, batch, ctx, 1 + k, all_logits=True, kv_budget=kv_budget, graph=not args.no_graph,
                      target_s=args.target_seconds)
        r.update(batch=batch, ctx=ctx, k=k)
        kernels = "; ".join(r.get("attention_kernels", []))
        print(f"  batch {batch:4d} ctx {ctx:5d} k {k:2d}: {r['seconds'] * 1e3:8.3f} ms "
              f"(min {r['min_seconds'] * 1e3:.3f}, {r['reps']} reps, {r['kv_buffers']} kv buffers) {kernels}", flush=True)
        return r

    print(f"{device_name}: {shape.params() / 1e9:.2f}B parameters, {report['dtype']}", flush=True)
    for batch in batches:
        for k in ks:
            if batch * (1 + k) <= args.max_tokens:
                report["decode"].append(point(batch, args.ctx, k))
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        for batch in [int(b) for b in args.context_batches.split(",")]:
            for k in [int(k) for k in args.context_draft_lengths.split(",")]:
                if batch * ctx * shape.kv_bytes_per_token_layer(2) <= kv_budget:
                    report["context"].append(point(batch, ctx, k))
    for tokens in [int(p) for p in args.prefill.split(",")]:
        r = time_pass(model, 1, 0, tokens, all_logits=False, kv_budget=kv_budget, graph=not args.no_graph,
                      target_s=args.target_seconds)
        r.update(tokens=tokens)
        print(f"  prefill {tokens:5d} tokens: {r['seconds'] * 1e3:8.3f} ms", flush=True)
        report["prefill"].append(r)
    report["wall_seconds"] = time.perf_counter() - t_start
    return report


def print_fit(fit: dict) -> None:
    print(f"fit over {fit['points_used']} points (batch x k <= {fit['token_budget']}): "
          f"base {fit['base_seconds'] * 1e3:.3f} ms, per seq {fit['per_seq_seconds'] * 1e6:.2f} us, "
          f"per draft token {fit['per_draft_token_seconds'] * 1e6:.2f} us, "
          f"prefill {fit['prefill_per_token_seconds'] * 1e6:.2f} us/token; "
          f"relative error median {fit['median_rel_error']:.3f}, max {fit['max_rel_error']:.3f}")
    for o in fit["outside"]:
        print(f"  beyond the budget: batch {o['batch']} k {o['k']}: measured {o['measured'] * 1e3:.2f} ms, "
              f"model {o['model'] * 1e3:.2f} ms ({o['measured'] / o['model']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", help="write the report (JSON) here")
    p.add_argument("--fit", metavar="REPORT[,REPORT...]",
                   help="fit a saved report instead of measuring; several (comma-separated) are fitted point by "
                        "point on the faster of their measurements (faster_of)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b", help="the measured model's shape")
    p.add_argument("--kv-heads", type=int, default=32, help="KV heads of llama2-7b (32: Llama-2-7B; 8: grouped-query)")
    p.add_argument("--ctx", type=int, default=1024, help="tokens already in each sequence's cache (the fitted grid)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256", help="batch sizes of the grid")
    p.add_argument("--draft-lengths", default="0,1,2,4,8,16,32", help="draft tokens per sequence of the grid")
    p.add_argument("--max-tokens", type=int, default=8448, help="skip grid points scoring more tokens than this")
    p.add_argument("--contexts", default="256,4096,8192", help="extra contexts for the context sweep ('' for none)")
    p.add_argument("--context-batches", default="1,8,64", help="batch sizes of the context sweep")
    p.add_argument("--context-draft-lengths", default="0,8", help="draft tokens per sequence of the context sweep")
    p.add_argument("--prefill", default="128,512,2048,4096", help="prompt lengths of the prefill points")
    p.add_argument("--target-seconds", type=float, default=0.4, help="replay time per point (5-40 replays)")
    p.add_argument("--no-graph", action="store_true", help="time eager passes instead of CUDA-graph replays")
    p.add_argument("--attention", choices=("auto", "flash", "efficient", "cudnn", "math"), default="auto",
                   help="the attention kernel: auto lets PyTorch pick for each shape; the others pin every "
                        "pass's scaled_dot_product_attention to one backend (a pass it cannot run fails)")
    p.add_argument("--pack-gqa", action="store_true",
                   help="grouped-query attention with each KV head's query heads packed into one head of group x "
                        "q_len queries, so the cache is read once per KV head (the causal order among a pass's new "
                        "positions is then not applied)")
    args = p.parse_args(argv)
    if args.fit:
        reports = []
        for path in args.fit.split(","):
            with open(path) as f:
                reports.append(json.load(f))
        report = reports[0] if len(reports) == 1 else faster_of(reports)
    else:
        report = measure(args)
    report["fit"] = fit_profile(report)
    print_fit(report["fit"])
    try:
        sp = report["speculation_fit"] = fit_speculation_profile(report)
        print(f"fit with the costs of a pass with drafts: base {sp['base_seconds'] * 1e3:.3f} ms, per seq "
              f"{sp['per_seq_seconds'] * 1e6:.2f} us; a pass with drafts {sp['spec_pass_seconds'] * 1e3:.3f} ms more, "
              f"each sequence with drafts {sp['per_drafted_seq_seconds'] * 1e6:.2f} us more, per draft token "
              f"{sp['per_draft_token_seconds'] * 1e6:.2f} us; relative error median {sp['median_rel_error']:.3f}, "
              f"max {sp['max_rel_error']:.3f}")
    except ValueError as e:
        print(f"no fit with the costs of a pass with drafts: {e}")
    if len({p["ctx"] for p in [*report["decode"], *report.get("context", [])]}) > 1:
        c = report["context_fit"] = fit_context_profile(report)
        print(f"fit with the context over {c['points_used']} points: base {c['base_seconds'] * 1e3:.3f} ms, "
              f"per seq {c['per_seq_seconds'] * 1e6:.2f} us + {c['per_context_token_seconds'] * 1e9:.1f} ns per context "
              f"token, per draft token {c['per_draft_token_seconds'] * 1e6:.2f} us + "
              f"{c['per_draft_context_token_seconds'] * 1e9:.2f} ns per context token; relative error median "
              f"{c['median_rel_error']:.3f}, max {c['max_rel_error']:.3f} (context-blind over the same points: "
              f"{c['flat_median_rel_error']:.3f}, {c['flat_max_rel_error']:.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
